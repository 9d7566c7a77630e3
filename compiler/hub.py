"""Checkpoints named by their Hugging Face Hub id (`--model-path Qwen/Qwen2.5-0.5B-Instruct`,
as SGLang takes them): fetched into the Hub's cache (`--download-dir`, else HF_HOME's), at
`--revision` (a branch, tag or commit; default main), with the Hub library's progress bars,
then compiled from the local snapshot like any folder. A path that exists is always a
path. Only what a compile reads is fetched: config, tokenizer and template files and
safetensors weights (PyTorch .bin weights where a repository has no safetensors). With
HF_HUB_OFFLINE=1 the cache alone answers.

The artefact is keyed by the files' contents, not the id or revision: the same weights
reached by a local folder and by an id are one cache entry."""

from __future__ import annotations

import re
from pathlib import Path

from kiln.args import ArgError, ServerArgs

# The flags that name a checkpoint folder.
PATH_FLAGS = {
    "model_path": "--model-path",
    "tokenizer_path": "--tokenizer-path",
    "speculative_draft_model_path": "--speculative-draft-model-path",
}
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?")
_METADATA = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
_SNAPSHOT = re.compile(r"models--(.+)")


def is_repo_id(value: str) -> bool:
    """A value that names a Hub repository and no path here."""
    return (
        not Path(value).exists()
        and _REPO_ID.fullmatch(value) is not None
        and ".." not in value
        and not value.endswith((".gguf", ".json", ".safetensors"))
    )


def local_paths(args: ServerArgs) -> ServerArgs:
    """`args` with each checkpoint flag that is a Hub id replaced by its local snapshot."""
    revisions = {
        "model_path": args.revision,
        "tokenizer_path": args.revision if args.tokenizer_path == args.model_path else None,
        "speculative_draft_model_path": args.speculative_draft_model_revision,
    }
    changes = {}
    for dest, flag in PATH_FLAGS.items():
        value = getattr(args, dest)
        if value and is_repo_id(value):
            changes[dest] = str(fetch(flag, value, revisions[dest], args.download_dir))
    return args.replace(**changes) if changes else args


def fetch(flag: str, repo_id: str, revision: str | None, cache_dir: str | None) -> Path:
    """The snapshot folder of `repo_id` at `revision`, fetched if the cache lacks it;
    ArgError naming `flag` when neither the cache nor the Hub can give it."""
    import huggingface_hub
    from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError

    def get(patterns: list[str]) -> Path:
        return Path(
            huggingface_hub.snapshot_download(
                repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=patterns
            )
        )

    try:
        folder = get([*_METADATA, "*.safetensors"])
        if not any(folder.glob("*.safetensors")):
            folder = get([*_METADATA, "*.bin", "*.pt"])
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        at = f" at revision {revision}" if revision else ""
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ArgError(
            f"{flag}: {repo_id} is not a path here, and the Hugging Face Hub could not give "
            f"it{at} ({why})"
        ) from None
    return folder


def hub_name(path: str | Path) -> str | None:
    """The repository id of a snapshot folder in the Hub's cache
    (.../models--ORG--NAME/snapshots/COMMIT), else None."""
    path = Path(path)
    if path.parent.name != "snapshots":
        return None
    match = _SNAPSHOT.fullmatch(path.parent.parent.name)
    return match.group(1).replace("--", "/") if match else None
