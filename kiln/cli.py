"""The `kiln` command: compile, generate, serve, launch."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import kiln
from kiln.args import ServerArgs, add_cli_args, explicit_values

# Server-argument flags are added with argparse.SUPPRESS as their default, so a namespace
# holds exactly what the user gave (YAML defaults and artefact checks depend on that);
# each subcommand's own options carry explicit defaults.
_SUPPRESS = argparse.SUPPRESS


class Parser(argparse.ArgumentParser):
    """argparse with a short usage line (the full one lists 300 flags) and a "did you
    mean" for mistyped flags and subcommands."""

    def error(self, message: str) -> NoReturn:
        hint = _suggestion(self, message)
        self.exit(2, f"usage: {self.usage or self.prog}\n{self.prog}: error: {message}{hint}\n")


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    typo = re.search(r"unrecognized arguments: (\S+)", message)
    if typo:
        words = [o for a in parser._actions for o in a.option_strings]
        wrong = typo.group(1).split("=")[0]
    else:
        choice = re.search(r"invalid choice: '([^']+)'", message)
        if not choice:
            return ""
        wrong = choice.group(1)
        words = [c for a in parser._actions if a.choices for c in map(str, a.choices)]
    close = difflib.get_close_matches(wrong, words, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _subcommand(
    sub: argparse._SubParsersAction, name: str, help: str, func: Any, artefact: bool
) -> argparse.ArgumentParser:
    """A subcommand taking every server flag (a whole SGLang command line carries over)."""
    usage = f"kiln {name} {'ARTEFACT ' if artefact else ''}[options]  (kiln {name} --help)"
    p = sub.add_parser(
        name, help=help, argument_default=_SUPPRESS, usage=usage, prog=f"kiln {name}"
    )
    if artefact:
        p.add_argument("artefact", help="artefact folder made by `kiln compile`")
    add_cli_args(p)
    p.set_defaults(func=func)
    return p


def _compile_parser(sub: argparse._SubParsersAction) -> None:
    p = _subcommand(
        sub,
        "compile",
        "compile a Hugging Face checkpoint into an artefact",
        _cmd_compile,
        artefact=False,
    )
    p.add_argument("-o", "--output", required=True, help="artefact folder to write")


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    # Compile-time flags given here must agree with the artefact.
    p = _subcommand(
        sub,
        "generate",
        "generate text from an artefact (offline engine)",
        _cmd_generate,
        artefact=True,
    )
    p.add_argument(
        "--prompt", action="append", required=True, help="prompt text; repeat the flag for a batch"
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true", default=False)
    p.add_argument(
        "--json", action="store_true", default=False, help="print each result as a JSON line"
    )


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    _subcommand(
        sub,
        "serve",
        "serve an artefact over an OpenAI-compatible HTTP API",
        _cmd_serve,
        artefact=True,
    )


def _launch_parser(sub: argparse._SubParsersAction) -> None:
    p = _subcommand(
        sub,
        "launch",
        "compile (through the artefact cache) and serve, in one step",
        _cmd_launch,
        artefact=False,
    )
    p.add_argument(
        "--artefact-dir",
        default=None,
        help="where the compiled artefact is kept (default: $KILN_CACHE_DIR or "
        "~/.cache/kiln, one folder per checkpoint)",
    )


def _cmd_serve(ns: argparse.Namespace) -> int:
    from kiln.serve.server import serve

    serve(ns.artefact, explicit_values(ns))
    return 0


def _cmd_launch(ns: argparse.Namespace) -> int:
    import hashlib
    from pathlib import Path

    from kiln.compiler.compile import compile_model
    from kiln.paths import cache_dir
    from kiln.serve.server import serve

    explicit = explicit_values(ns)
    args = ServerArgs(**explicit)
    if not args.model_path:
        raise ValueError("--model-path: required (the Hugging Face checkpoint folder)")
    out = ns.artefact_dir
    if out is None:
        root = cache_dir()
        ckpt = Path(args.model_path).resolve()
        tag = hashlib.sha256(str(ckpt).encode()).hexdigest()[:12]
        out = root / f"{ckpt.name}-{tag}"
    result = compile_model(args, out)
    _report(result)
    serve(result.path, explicit)
    return 0


def _report(result: Any) -> None:
    state = "cache hit" if result.cache_hit else "compiled"
    print(
        f"{state}: {result.path} ({result.target}, {result.dtype}, "
        f"key {result.cache_key[:16]}, {result.seconds:.2f}s)"
    )


def _cmd_compile(ns: argparse.Namespace) -> int:
    from kiln.compiler.compile import compile_model

    args = ServerArgs.from_namespace(ns)
    result = compile_model(args, ns.output)
    _report(result)
    return 0


def _cmd_generate(ns: argparse.Namespace) -> int:
    from kiln.runtime.engine import Engine

    engine = Engine(ns.artefact, **explicit_values(ns))
    params = {
        "max_new_tokens": ns.max_new_tokens,
        "temperature": ns.temperature,
        "top_p": ns.top_p,
        "top_k": ns.top_k,
        "min_p": ns.min_p,
        "seed": ns.seed,
        "ignore_eos": ns.ignore_eos,
    }
    results = engine.generate(ns.prompt, params)
    for prompt, r in zip(ns.prompt, results, strict=True):
        if ns.json:
            print(json.dumps({"prompt": prompt, **r}))
        else:  # as vLLM's examples print: quoted, so where the prompt ends is plain
            print(f"Prompt: {prompt!r}\nGenerated: {r['text']!r}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(
        prog="kiln",
        description="compile and serve LLMs",
        usage="kiln {compile,generate,serve,launch} ...  (kiln --help)",
    )
    parser.add_argument("--version", action="version", version=f"kiln {kiln.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    _compile_parser(sub)
    _generate_parser(sub)
    _serve_parser(sub)
    _launch_parser(sub)
    ns, extra = parser.parse_known_args(argv)
    if extra:  # reported by the subcommand, which knows its flags (for "did you mean")
        sub.choices[ns.command].error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=getattr(ns, "log_level", "info").upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(ns.func(ns))
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, OSError, MemoryError) as e:
        # Our errors are one line that names the flag or file; no traceback for users.
        print(f"kiln {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
