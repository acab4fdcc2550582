"""``python -m sgl_jax.launch_server [flags]``: the HTTP server (also ``sgl-jax-server``).

Only argparse and ServerArgs are imported at module level: ``--help`` and flag errors must
answer instantly, without importing JAX, FastAPI or the engine.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from sgl_jax.srt.server_args import ServerArgs

logger = logging.getLogger("sgl_jax.launch_server")

DESCRIPTION = """\
Serve a Mixture-of-Experts model over HTTP: the native SGLang /generate API and the
OpenAI-compatible /v1/completions, /v1/chat/completions and /v1/models, plus /health,
/health_generate, /get_model_info, /get_server_info, /flush_cache and /abort_request.

With --enable-return-routed-experts, a request with "return_routed_experts": true gets the
router's top-k expert ids of every token and layer as base64 little-endian int32 in
meta_info["routed_experts"] (OpenAI routes: choices[i].meta_info.routed_experts); reshape
them to (-1, num_hidden_layers, num_experts_per_tok) from /get_model_info. Behind a gateway
that drops that field (sglang-router), --return-routed-experts-default returns them for every
request that does not say false (docs/scaling.md).

SIGTERM or Ctrl-C aborts running requests, stops the engine's processes and exits 0; if an
engine process dies, requests get HTTP 503 and the server exits with code 1.

Multi-node (--nnodes N): run the same command on every host with its --node-rank and node
0's --dist-init-addr, and the same secret on every node (export SGL_JAX_NODE_SECRET, or
--node-secret-file PATH); node 0 serves HTTP, the other nodes run its steps and exit when it
stops. A node that dies or goes silent for --dist-timeout seconds stops the job."""

EPILOG = """\
example:
  python -m sgl_jax.launch_server --port 30000 --enable-return-routed-experts
  curl -s localhost:30000/generate -d '{"text": "Hello", "sampling_params": {"max_new_tokens": 8}}'
"""


class _Interrupted(Exception):
    pass


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_jax.launch_server", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ServerArgs.add_cli_args(parser)
    return parser


def _describe(server_args: ServerArgs) -> str:
    if server_args.disable_precompile:
        return "compiling on first use (--disable-precompile)"
    return (f"precompiling decode batch sizes {server_args.bs_paddings()} and prefill token "
            f"counts {server_args.token_paddings()}")


def _interrupt(sig: int, frame: object) -> None:
    raise _Interrupted(signal.Signals(sig).name)


def _run_follower_node(server_args: ServerArgs) -> int:
    from sgl_jax.srt.managers.multi_node import run_follower
    from sgl_jax.srt.utils import enable_compilation_cache

    logger.info("Node %d of %d: joining node 0 at %s", server_args.node_rank,
                server_args.nnodes, server_args.dist_init_addr)
    try:
        enable_compilation_cache(server_args)
        return run_follower(server_args)
    except _Interrupted as e:
        logger.info("Interrupted by %s", e)
        return 0


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        server_args = ServerArgs.from_cli_args(args)
    except ValueError as e:
        parser.error(str(e))
    if server_args.nnodes > 1:  # fail now, before loading anything, if it has no secret
        from sgl_jax.srt.managers.node_auth import load_node_secret

        try:
            load_node_secret(server_args.node_secret_file)
        except ValueError as e:
            parser.error(str(e))

    from sgl_jax.srt.utils import configure_logging

    configure_logging(server_args.log_level)
    # Until uvicorn takes the signals over, SIGTERM / SIGINT stop the start-up cleanly (the
    # children exit on their own when this process is gone).
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    if server_args.node_rank > 0:  # a follower node: no HTTP, it runs node 0's steps
        sys.exit(_run_follower_node(server_args))
    try:
        from sgl_jax.srt.configs.model_config import resolve_model_path
        from sgl_jax.srt.entrypoints.engine import EngineStartupError
        from sgl_jax.srt.entrypoints.http_server import run_server

        logger.info("Loading model %s; %s", resolve_model_path(server_args.model_path),
                    _describe(server_args))
        code = run_server(server_args)
    except _Interrupted as e:
        logger.info("Interrupted by %s during start-up", e)
        code = 0
    except (EngineStartupError, ValueError) as e:
        logger.error("Start-up failed: %s", e)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
