"""``python -m ddtree_ops.sim <sglang launch_server flags>``: the simulated SGLang server."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Parse like SGLang (exit 2 on bad flags), then run the launch sequence."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from ddtree_ops.sim.args import SimSettingsError, parse_server_args, sim_settings_from_env
    from ddtree_ops.sim.logs import configure_logging, main_logger

    args, warnings = parse_server_args(argv)
    configure_logging(args.log_level)
    plugin = None
    if args.ddtree is not None:
        from ddtree_ops.sim.plugin import PluginMissing, find_ddtree_plugin

        try:
            plugin = find_ddtree_plugin(os.environ)
        except PluginMissing as exc:
            # As SGLang 0.5.23 fails without the plugin: resolving the server arguments
            # raises, before any port opens, and the process exits 1.
            sys.stderr.write(
                "Traceback (most recent call last):\n"
                '  File "sglang/srt/arg_groups/speculative_hook.py", in handle_speculative_decoding\n'
                "    algo = SpeculativeAlgorithm.from_string(cfg.speculative_algorithm)\n"
                '  File "sglang/srt/speculative/spec_info.py", line 65, in from_string\n'
                f"ValueError: Unknown speculative algorithm name: {args.speculative_algorithm}\n"
                f"[simulator: {exc}]\n"
            )
            return 1
    for w in warnings:
        main_logger.warning(f"\033[1;33m{w}\033[0m", extra={"prefix": ""})
    if args.ddtree is not None:
        # The DDTree plugin's resolution line (ddtree_registration.resolve_ddtree_server_args).
        tree = args.ddtree
        main_logger.info(
            f"DDTREE: budget={tree.budget} topk={tree.topk} draft_block={tree.draft_block_size} "
            f"verify_backend=simulated draft_backend=simulated decode_graphs={args.cuda_graph_backend_decode}",
            extra={"prefix": ""},
        )
    try:
        settings = sim_settings_from_env()
    except SimSettingsError as exc:
        main_logger.error(f"Invalid simulator setting: {exc}", extra={"prefix": ""})
        return 2
    from ddtree_ops.sim.server import serve

    # SGLang reports the flags it was given, space-joined (server_args.py, prepare_server_args).
    launch_command = " ".join(argv)
    main_logger.info(f"server_args={args!r}", extra={"prefix": ""})
    return asyncio.run(serve(args, settings, launch_command, plugin))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: with torch loaded it takes seconds on a busy machine,
    # which would stretch the shutdown that SIM_SHUTDOWN_DRAIN_S is meant to define.
    os._exit(code)
