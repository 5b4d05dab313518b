"""Old module path of the vLLM connector (``kv_connector_module_path: kvpushd_client.vllm_connector``)."""
from .vllm.connector import *  # noqa: F403
