"""placeholder"""
import argparse
def add_args(p: argparse.ArgumentParser) -> None:
    pass
def run_demo(args: argparse.Namespace) -> int:
    return 0
