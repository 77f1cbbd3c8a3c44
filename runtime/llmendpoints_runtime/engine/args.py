"""vLLM's own argument parser, so that configuration is validated by vLLM itself
(``config.py`` turns the environment into its argv)."""

from __future__ import annotations

from argparse import Namespace


class EngineArgsError(Exception):
    """vLLM's parser or its serve-argument checks rejected the arguments."""


def build_arg_parser():
    """vLLM's own `vllm serve` parser, raising EngineArgsError instead of exiting."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class _RaisingParser(FlexibleArgumentParser):
        def error(self, message: str):  # argparse would print usage and exit(2)
            raise EngineArgsError(message)

    return make_arg_parser(_RaisingParser(prog="llmendpoints-runtime", add_help=True))


def parse_engine_args(parser, argv: list[str]) -> Namespace:
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    namespace = parser.parse_args(argv)
    try:
        validate_parsed_serve_args(namespace)
    except (TypeError, ValueError) as exc:
        raise EngineArgsError(str(exc).removeprefix("Error: ")) from None
    return namespace
