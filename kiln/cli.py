"""The `kiln` command: compile, generate, serve, launch, cache, inspect, diff.

Cheap paths stay cheap: --help, --version, flag refusals, cache hits, `cache`, `inspect`
and `diff` never import torch."""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kiln.args import ServerArgs, add_cli_args, explicit_values
from kiln.terminal import configure_logging, printable
from kiln.version import __version__

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
    p.add_argument(
        "-o",
        "--output",
        default=None,
        help="also place the artefact here (hard links to the cache entry); "
        "default: print the cache entry's path",
    )


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
        help="also place the artefact here (default: only in the cache, $KILN_CACHE_DIR "
        "or ~/.cache/kiln)",
    )


def _command(
    sub: argparse._SubParsersAction, name: str, help: str, usage: str
) -> argparse.ArgumentParser:
    """A `kiln NAME` subcommand's parser."""
    return sub.add_parser(name, help=help, usage=usage, prog=f"kiln {name}")


def _cache_parser(sub: argparse._SubParsersAction) -> None:
    about = "the compiled-artefact cache: key, ls, rm, gc"
    p = _command(sub, "cache", about, "kiln cache {key,ls,rm,gc} ...")
    actions = p.add_subparsers(dest="action", required=True, parser_class=Parser)
    key = actions.add_parser(
        "key",
        help="print the cache key of a compile (for CI cache keys)",
        argument_default=_SUPPRESS,
        usage="kiln cache key --model-path CKPT [compile flags]",
        prog="kiln cache key",
    )
    add_cli_args(key)
    key.add_argument(
        "--rehash", action="store_true", default=False, help="read every file, ignore memos"
    )
    actions.add_parser("ls", help="list entries, least recently used first", prog="kiln cache ls")
    rm = actions.add_parser(
        "rm", help="remove entries by key (a prefix will do)", prog="kiln cache rm"
    )
    rm.add_argument("keys", nargs="+", metavar="KEY")
    gc = actions.add_parser(
        "gc", help="remove least recently used entries past a size", prog="kiln cache gc"
    )
    gc.add_argument(
        "--max-size",
        required=True,
        help="e.g. 20G, 500M, 1T (bytes if no suffix); every compile that misses also "
        "trims the cache to $KILN_CACHE_MAX_SIZE (default 20G; none: no limit)",
    )
    p.set_defaults(func=_cmd_cache)


def _cmd_cache(ns: argparse.Namespace) -> int:
    import time

    from kiln.compiler.hub import local_paths
    from kiln.compiler.key import compile_key
    from kiln.compiler.store import Store, max_cache_bytes, max_cache_setting, parse_size

    store = Store()
    if ns.action == "key":
        print(compile_key(local_paths(ServerArgs.from_namespace(ns)), rehash=ns.rehash).key)
    elif ns.action == "ls":
        bound = "no bound" if max_cache_bytes() is None else f"bound {max_cache_setting()}"
        entries = sorted(store.entries(), key=lambda e: e.last_used)
        for e in entries:
            age = time.time() - e.last_used
            print(f"{e.key[:16]}  {e.bytes / 1e6:9.1f} MB  used {_ago(age):>9}  {e.summary}")
        total = sum(e.bytes for e in entries)
        print(f"{len(entries)} entries, {total / 1e6:.1f} MB in {store.root} ({bound})")
    elif ns.action == "rm":
        for prefix in ns.keys:
            found = store.find(prefix)
            if len(found) != 1:
                what = "no entry" if not found else f"{len(found)} entries"
                raise ValueError(f"kiln cache rm {prefix}: {what} with that key")
            store.remove(found[0].key)
            print(f"removed {found[0].key[:16]} ({found[0].summary})")
    else:
        for e in store.gc(parse_size(ns.max_size, "--max-size")):
            print(f"removed {e.key[:16]} ({e.summary}, {e.bytes / 1e6:.1f} MB)")
    return 0


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return "just now"


def _inspect_parser(sub: argparse._SubParsersAction) -> None:
    about = "what an artefact holds: model, target, passes, kernels, weights, KV"
    p = _command(sub, "inspect", about, "kiln inspect ARTEFACT [--graph | --json | --dot | --step]")
    p.add_argument("artefact")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--graph", action="store_true", help="print the IR")
    how.add_argument("--json", action="store_true", help="the summary as JSON")
    how.add_argument("--dot", action="store_true", help="the graph for graphviz")
    how.add_argument("--step", action="store_true", help="the step lowered to C")
    p.set_defaults(func=_cmd_inspect)
    about = "how two artefacts differ: cache factors, graph, weights"
    d = _command(sub, "diff", about, "kiln diff ARTEFACT_A ARTEFACT_B")
    d.add_argument("a")
    d.add_argument("b")
    d.set_defaults(func=_cmd_diff)


def _replay_parser(sub: argparse._SubParsersAction) -> None:
    about = "send a --crash-dump-folder dump's requests to a server again, as they arrived"
    p = _command(sub, "replay", about, "kiln replay DUMP --url URL [--api-key KEY] [--speed S]")
    p.add_argument("dump", help="a crash_dump_*.json file")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    p.add_argument("--api-key", help="the server's --api-key, if it has one")
    p.add_argument(
        "--speed", type=float, default=1.0, help="arrival times divided by this (default 1)"
    )
    p.set_defaults(func=_cmd_replay)


def _cmd_replay(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from kiln.serve import replay

    if not ns.speed > 0:
        raise ValueError(f"--speed {ns.speed}: must be above 0")
    lines, ok = replay.report(
        replay.replay(replay.load(Path(ns.dump)), ns.url, ns.api_key, ns.speed)
    )
    print("\n".join(lines))
    return 0 if ok else 1


def _cmd_inspect(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from kiln.compiler import report

    root = Path(ns.artefact)
    if ns.graph or ns.dot:
        graph = report.load(root)[1]
        print(report.to_dot(graph) if ns.dot else graph.format())
    elif ns.step:
        print(report.step_source(root), end="")
    elif ns.json:
        print(json.dumps(report.summary(root), indent=1))
    else:
        print(report.format_summary(report.summary(root)))
    return 0


def _cmd_diff(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from kiln.compiler import report

    lines = report.diff(Path(ns.a), Path(ns.b))
    print("\n".join(lines) if lines else "same cache key inputs, graph and files")
    return 0


def _cmd_serve(ns: argparse.Namespace) -> int:
    import gc
    from pathlib import Path

    # No cyclic collection until the start is done: the imports and the artefact's load
    # make few cycles, and the collections they set off walked the growing heap, ~80 ms
    # of a 1.3 s start (2-core Zen 3). The server freezes that heap and turns the
    # collector back on once it is ready (runtime/model_runner.py freeze_startup_heap).
    gc.disable()
    from kiln.core.artefact import ArtefactError, FileCheck, read_manifest

    # The artefact's checksums start before the server's imports (torch's ~1 s) and run
    # beside them; a manifest that cannot be read is left for the server to report.
    try:
        check = FileCheck(Path(ns.artefact), read_manifest(Path(ns.artefact)))
    except (ArtefactError, OSError):
        check = None
    from kiln.serve.server import serve

    serve(ns.artefact, explicit_values(ns), check, clean_start=True)
    return 0


def _cmd_launch(ns: argparse.Namespace) -> int:
    from kiln.compiler.store import compile_cached
    from kiln.serve.server import serve

    explicit = explicit_values(ns)
    result = compile_cached(ServerArgs(**explicit), _build, ns.artefact_dir)
    _report(result)
    serve(result.path, explicit, clean_start=result.cache_hit)
    return 0


def _build(args: ServerArgs, key: Any, out: Any) -> None:
    """The compile driver, imported only on a cache miss (it loads torch; a hit must not)."""
    from kiln.compiler.compile import build_artefact

    build_artefact(args, key, out)


def _report(result: Any) -> None:
    state = "cache hit" if result.cache_hit else "compiled"
    if result.miss:
        print(f"cache miss; {result.miss[0]} differs in:")
        for line in result.miss[1:]:
            print(f"  {line}")
    print(
        f"{state}: {result.path} ({result.target}, {result.dtype}, "
        f"key {result.cache_key[:16]}, {result.seconds:.2f}s)"
    )


def _cmd_compile(ns: argparse.Namespace) -> int:
    from kiln.compiler.store import compile_cached

    result = compile_cached(ServerArgs.from_namespace(ns), _build, ns.output)
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
    results = engine.generate(list(ns.prompt), params)
    assert isinstance(results, list)  # a list of prompts gives a list of results
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
        usage="kiln {compile,generate,serve,launch,cache,inspect,diff,replay} ...  (kiln --help)",
    )
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    _compile_parser(sub)
    _generate_parser(sub)
    _serve_parser(sub)
    _launch_parser(sub)
    _cache_parser(sub)
    _inspect_parser(sub)
    _replay_parser(sub)
    ns, extra = parser.parse_known_args(argv)
    if extra:  # reported by the subcommand, which knows its flags (for "did you mean")
        sub.choices[ns.command].error(f"unrecognized arguments: {' '.join(extra)}")
    configure_logging(getattr(ns, "log_level", "info"))
    try:
        return int(ns.func(ns))
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, OSError, MemoryError) as e:
        # Our errors are one line that names the flag or file; no traceback for users.
        print(f"kiln {ns.command}: error: {printable(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
