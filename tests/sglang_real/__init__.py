"""The real SGLang 0.5.23 server on CPU with tiny models, for integration tests.

setup_env.py builds .cache/sglang-cpu (venv, libcuda stub, test-only stand-in plugin);
models.py writes the tiny target and DFlash draft; server.py starts/stops/queries the server.
"""
