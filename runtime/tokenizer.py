"""The artefact's tokenizer, read with the `tokenizers` library alone where that is exact.

Importing transformers' tokenizer classes costs 0.9 s of a server start on a slow core (more
than everything kiln itself does before the first token). For the common case, a fast
tokenizer whose config names the plain class (`PreTrainedTokenizerFast` /
`TokenizersBackend`: what the GGUF import writes, and most Hugging Face checkpoints),
`FastTokenizer` reads `tokenizer.json` with `tokenizers` and renders chat templates with
jinja2's sandbox set up as transformers sets it up, so encode, decode, special tokens and
templates give what `AutoTokenizer` gives (tests/runtime/test_tokenizer.py holds it to that).

Anything this module does not reproduce exactly (another class, a config key it does not
know, a special token the vocabulary lacks, a vocabulary large enough for transformers'
pre-tokenizer patches, truncation or padding in tokenizer.json, a special_tokens_map.json
beside it) is loaded by transformers instead; `load_tokenizer` logs why.

An artefact is untrusted: the tokenizer is built from the files its manifest lists, read
once and checked (`Artefact.tokenizer_files`), never from whatever else lies in the folder.
transformers gets a private copy of exactly those files, with remote code refused, and a
config that asks for custom code (`auto_map`) is refused before it is asked.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from kiln.core.artefact import TOKENIZER_DIR, TOKENIZER_FILES, ArtefactError, open_member

log = logging.getLogger("kiln.tokenizer")

# A tokenizer's files by name (tokenizer.json, tokenizer_config.json...), as bytes.
TokenizerFiles = Mapping[str, bytes]

PLAIN_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
# transformers' named special tokens: each becomes a variable of the chat template.
NAMED_SPECIAL = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Config keys whose meaning FastTokenizer reproduces, or which change nothing it does
# (padding and truncation sides, lengths, input names: kiln encodes one text, unpadded).
KNOWN_KEYS = frozenset(
    {
        *NAMED_SPECIAL,
        "tokenizer_class",
        "backend",
        "added_tokens_decoder",
        "additional_special_tokens",
        "extra_special_tokens",
        "add_bos_token",
        "add_eos_token",
        "chat_template",
        "clean_up_tokenization_spaces",
        "model_max_length",
        "model_input_names",
        "padding_side",
        "truncation_side",
        "name_or_path",
        "split_special_tokens",
    }
)
# transformers rewrites some pre-tokenizers of vocabularies this large (its Mistral regex
# patch); those load through transformers.
MAX_VOCAB = 100_000
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Files transformers also reads for special tokens and templates (an artefact carries them
# when the checkpoint has them): their meaning is not reproduced here.
OTHER_FILES = ("special_tokens_map.json", "added_tokens.json", "chat_template.json")
_ADDED_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


class NotExact(Exception):
    """The folder needs something FastTokenizer does not reproduce; the message says what."""


class TokenizerError(ValueError):
    """The tokenizer files are unusable; one line, starting with the file's name."""


class FastTokenizer:
    """The subset of a transformers fast tokenizer kiln's server uses, on `tokenizers`."""

    def __init__(self, files: TokenizerFiles) -> None:
        from tokenizers import Tokenizer

        config = _read_config(files)
        unknown = sorted(set(config) - KNOWN_KEYS)
        if unknown:
            raise NotExact(f"tokenizer_config.json sets {', '.join(unknown)}")
        if config.get("tokenizer_class") not in PLAIN_CLASSES:
            raise NotExact(f"tokenizer_class {config.get('tokenizer_class')!r}")
        if config.get("split_special_tokens"):
            raise NotExact("split_special_tokens")
        if "tokenizer.json" not in files:
            raise NotExact("no tokenizer.json")
        other = [f for f in OTHER_FILES if f in files]
        if other:
            raise NotExact(f"the folder has {', '.join(other)}")
        try:
            backend = Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
        except Exception as e:  # tokenizers raises its own exception type for any defect
            raise TokenizerError(f"tokenizer.json is invalid: {_first_line(e)}") from None
        if backend.truncation is not None or backend.padding is not None:
            raise NotExact("tokenizer.json sets truncation or padding")
        if backend.get_vocab_size() > MAX_VOCAB:
            raise NotExact(f"a vocabulary over {MAX_VOCAB} tokens")
        added = backend.get_added_tokens_decoder()
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            have = added.get(int(key))
            if have is None or any(getattr(have, f) != entry.get(f) for f in _ADDED_FIELDS):
                raise NotExact(f"added token {key} differs from tokenizer.json's")

        special = {id_: t.content for id_, t in added.items() if t.special}
        ids = {content: id_ for id_, content in special.items()}
        self.special_tokens_map: dict[str, str] = {}
        for name in NAMED_SPECIAL:
            token = _content(config.get(name))
            if token is None:
                continue
            if token not in ids:
                raise NotExact(f"{name} {token!r} is not a special token of tokenizer.json")
            self.special_tokens_map[name] = token
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        if isinstance(extra, Mapping) and extra:
            raise NotExact("named extra_special_tokens")
        for token in map(_content, extra or []):
            if token not in ids:
                raise NotExact(f"extra special token {token!r} is not in tokenizer.json")

        # add_bos_token / add_eos_token: transformers drops them when tokenizer.json exists
        # (its post-processor decides what surrounds a text; none: nothing does).
        self.backend_tokenizer = backend
        self.added_tokens_decoder = dict(sorted(added.items()))
        listed = [*self.special_tokens_map.values(), *map(_content, extra or [])]
        self.all_special_ids = sorted({ids[t] for t in listed if t is not None})
        self.chat_template = _chat_template(files, config)
        # transformers skips its clean-up for BPE models (it would eat real spaces there).
        bpe = type(backend.model).__name__ == "BPE"
        self._clean_up = bool(config.get("clean_up_tokenization_spaces")) and not bpe
        self._templates: dict[str, Any] = {}

    # The batch calls, with a batch of one: they let go of the GIL (the single ones do not),
    # so a megabyte prompt on a tokenizer thread never stalls the event loop (0.3 us more).
    # encode_batch_fast leaves out the character offsets: freeing a full encoding of a
    # 4.8 MB prompt held the GIL for 0.4-0.6 s (0.07-0.12 s without them), and the ids
    # come 2.4x sooner.
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Every text's ids in one call (the Rust library's threads share them out)."""
        fast = self.backend_tokenizer.encode_batch_fast
        return [list(e.ids) for e in fast(texts, add_special_tokens=add_special_tokens)]

    def encode_pairs(self, pairs: list[tuple[str, str]]) -> list[list[int]]:
        """Each (text, text_pair)'s ids through the tokenizer's pair template (a
        cross-encoder's query and document), as transformers' tokenizer(text, text_pair)."""
        fast = self.backend_tokenizer.encode_batch_fast
        return [list(e.ids) for e in fast(pairs, add_special_tokens=True)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        batch = self.backend_tokenizer.decode_batch(
            [list(ids)], skip_special_tokens=skip_special_tokens
        )
        text = batch[0]
        return _clean_up_spaces(text) if self._clean_up else text

    def convert_ids_to_tokens(self, token: int) -> str | None:
        return self.backend_tokenizer.id_to_token(token)

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        chat_template: str | None = None,
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The conversation as text, as transformers renders it (`tokenize=False` only;
        `tools` as OpenAI's tool objects, which transformers passes as they are)."""
        if tokenize:
            raise ValueError("FastTokenizer renders chat templates as text; encode the text")
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template")
        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        compiled = self._templates.get(template)
        if compiled is None:
            compiled = self._templates[template] = _compile(template)
        messages = [_with_reasoning_aliases(_plain(dict(m))) for m in conversation]
        return str(
            compiled.render(
                messages=messages,
                tools=None if tools is None else _plain(list(tools)),
                documents=None if documents is None else _plain(list(documents)),
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens_map, **_plain(kwargs)},
            )
        )


def read_folder(folder: Path) -> dict[str, bytes]:
    """A checkpoint's tokenizer files (the names an artefact carries), as `load_tokenizer`
    takes them; symbolic links are not followed."""
    files = {}
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file() and not path.is_symlink():
            files[name] = path.read_bytes()
    return files


def import_tokenizer_libraries(artefact: Path) -> None:
    """Import what `load_tokenizer` will most likely need for the artefact's tokenizer (on
    a thread, while the artefact's checksums run): `tokenizers` where the config names the
    plain class, transformers' AutoTokenizer (~1.3 s on a slow core) where it does not.
    Only a hint: the config is read again, checked, before anything uses it."""
    try:
        with os.fdopen(open_member(artefact, f"{TOKENIZER_DIR}/tokenizer_config.json"), "rb") as f:
            plain = _read_config({"tokenizer_config.json": f.read()}).get("tokenizer_class")
    except (ArtefactError, NotExact, OSError):
        plain = None
    if plain in PLAIN_CLASSES:
        import tokenizers  # noqa: F401
    else:
        from transformers import AutoTokenizer  # noqa: F401


def load_tokenizer(files: TokenizerFiles) -> Any:
    """The tokenizer made of `files` (None when they hold none): a `FastTokenizer` where
    that is exact, else transformers' `AutoTokenizer` on a private copy of them. Raises
    TokenizerError (one line) for files that ask for custom code or do not load."""
    if not files.keys() & {"tokenizer.json", "tokenizer_config.json"}:
        return None
    if "tokenizer_config.json" in files:
        try:
            config = _read_config(files)
        except NotExact as e:
            raise TokenizerError(str(e)) from None
        if "auto_map" in config:
            raise TokenizerError(
                "tokenizer_config.json asks for custom tokenizer code (auto_map); kiln never "
                "runs code from a checkpoint or an artefact"
            )
    try:
        return FastTokenizer(files)
    except NotExact as e:
        log.info("tokenizer loaded by transformers (%s)", e)
    return _transformers_tokenizer(files)


def _transformers_tokenizer(files: TokenizerFiles) -> Any:
    from transformers import AutoTokenizer

    folder = Path(tempfile.mkdtemp(prefix="kiln-tokenizer-"))
    try:
        for name, data in files.items():
            if name in TOKENIZER_FILES:  # plain names: nothing lands outside `folder`
                (folder / name).write_bytes(data)
        return AutoTokenizer.from_pretrained(
            str(folder), trust_remote_code=False, local_files_only=True
        )
    except Exception as e:  # transformers' errors come in many types; all are the files'
        raise TokenizerError(f"the tokenizer files do not load: {_first_line(e)}") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else type(e).__name__


def _read_config(files: TokenizerFiles) -> dict[str, Any]:
    if "tokenizer_config.json" not in files:
        raise NotExact("no tokenizer_config.json")
    try:
        config = json.loads(files["tokenizer_config.json"])
    except ValueError as e:
        raise NotExact(f"tokenizer_config.json unreadable: {e}") from e
    if not isinstance(config, dict):
        raise NotExact("tokenizer_config.json is not an object")
    return config


def _content(token: Any) -> str | None:
    """A special token as the config spells it: a string, or an AddedToken's fields."""
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _chat_template(files: TokenizerFiles, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja wins over the config's entry, as in transformers."""
    if CHAT_TEMPLATE_FILE in files:
        try:
            return files[CHAT_TEMPLATE_FILE].decode("utf-8")
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{CHAT_TEMPLATE_FILE} is not UTF-8: {e}") from None
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    raise NotExact("several named chat templates")


def _clean_up_spaces(text: str) -> str:
    """The clean-up transformers applies after decoding when a non-BPE config asks for it:
    no space before punctuation or English contractions."""
    for spaced, tight in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, tight)
    return text


_REASONING = ("reasoning_content", "thinking", "reasoning")


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning under every name templates read it by, as transformers passes it."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """Only JSON-shaped data reaches a template (a template is untrusted code): kiln passes
    request JSON, which this keeps as it is."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    for kind in (bool, int, float, str):  # subclasses (an enum's value): their base value
        if isinstance(value, kind):
            return kind(value)
    return str(value)


def _compile(template: str) -> Any:
    """A chat template compiled in jinja2's immutable sandbox, with the options, filters and
    globals transformers gives templates (so a template renders the same under both)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers): the body as is."""

        tags = {"generation"}  # noqa: RUF012 (jinja2's own class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class SafeNamespace(jinja2.utils.Namespace):
        """namespace() without underscore names (no way to CPython's internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                SafeNamespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            SafeNamespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}")

    class Dicts:
        """dict() and dict.fromkeys() only."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=strftime_now,
        dict=Dicts(),
        namespace=SafeNamespace,
    )
    return env.from_string(template)
