"""Test plugin module: what the sglang.srt.plugins entry point of the test bundle loads."""


def register() -> str:
    return "ddtree_mini registered"
