"""The only package that imports nixl."""
