"""A model folder's tokenizer read from its files with the `tokenizers` library alone.

Importing transformers (and torch through it) costs seconds of CPU, which every gateway and
inference server start paid for a few things of the tokenizer: its `tokenizers` backend, token ids,
the special tokens' ids, encoding, decoding and the chat template. `load_tokenizer` builds those from
tokenizer.json, tokenizer_config.json and the chat template files exactly as transformers' generic
`TokenizersBackend` does (the same backend, added and special tokens merged the same way),
and loads any folder it cannot read that way (no tokenizer.json, a tokenizer class of its own, remote
code) through transformers' AutoTokenizer, as before.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer
from tokenizers.processors import TemplateProcessing

from polar.inference.models import ALIASES, resolve_model

# The tokenizer classes transformers loads tokenizer.json for as it is; every other class builds its
# backend in code of its own.
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Model types whose tokenizer transformers builds with a class of their own even where the folder
# names a generic one (its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS that map to such a class;
# tests/unit/test_tokenizer_files.py checks the list against the installed transformers).
OWN_CLASS_MODEL_TYPES = frozenset(
    {
        "hyperclovax_vision_v2",
        "qwen2",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen4_exp",
        "siglip2",
    }
)
# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES), in its order.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class FileTokenizer:
    """What the gateway and the torch engine use of a Hugging Face tokenizer, with the same names and
    answers."""

    backend_tokenizer: Tokenizer
    unk_token: str | None
    bos_token: str | None = None
    eos_token: str | None = None
    # The folder's chat template: a name -> template dict where it has several, as transformers reads it.
    chat_template: str | dict[str, str] | None = None
    # tokenizer_config.json's clean_up_tokenization_spaces, which transformers applies to a decoded
    # text except where the tokenizer's model is BPE.
    clean_up_tokenization_spaces: bool = False

    @property
    def unk_token_id(self) -> int | None:
        return None if self.unk_token is None else self.backend_tokenizer.token_to_id(self.unk_token)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.convert_tokens_to_ids(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.convert_tokens_to_ids(self.eos_token)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """The token's id; the unknown token's id (or None) when the vocabulary has no such token."""
        token_id = self.backend_tokenizer.token_to_id(token)
        return self.unk_token_id if token_id is None else token_id

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces and type(self.backend_tokenizer.model).__name__ != "BPE":
            for spaced, joined in _CLEAN_UP:
                text = text.replace(spaced, joined)
        return text


# transformers' clean_up_tokenization, in its order.
_CLEAN_UP = (
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
)


def load_tokenizer(spec: str) -> Any:
    """The tokenizer of a model alias ("tiny") or folder: a `FileTokenizer` where its files allow,
    else the folder's Hugging Face tokenizer (AutoTokenizer)."""
    source = resolve_model(spec) if spec in ALIASES else spec
    tokenizer = read_tokenizer_files(Path(source))
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def read_tokenizer_files(folder: Path) -> FileTokenizer | None:
    """The folder's tokenizer as transformers' AutoTokenizer would build it, or None where
    AutoTokenizer would build it otherwise than from tokenizer.json with the generic class."""
    config = _read_json(folder / "tokenizer_config.json")
    if (
        config is None
        or not (folder / "tokenizer.json").is_file()
        or config.get("tokenizer_class") not in GENERIC_TOKENIZER_CLASSES
        # Remote code, a versioned tokenizer file, Mistral's regex fix or tekken.json: other loaders.
        or "auto_map" in config
        or "fast_tokenizer_files" in config
        or config.get("fix_mistral_regex")
        or (folder / "tekken.json").exists()
    ):
        return None
    model_config = _read_json(folder / "config.json") or {}
    if {model_config.get("model_type"), model_config.get("model_name")} & OWN_CLASS_MODEL_TYPES:
        return None
    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    named, extra, added = _special_tokens(folder, config, backend)
    _add_tokens(backend, named, extra, added)
    # A tokenizer.json without a post-processor gets transformers' (which adds no bos or eos).
    if backend.post_processor is None:
        backend.post_processor = TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    return FileTokenizer(
        backend,
        *(None if named.get(name) is None else str(named[name]) for name in ("unk_token", "bos_token", "eos_token")),
        chat_template=_chat_template(folder, config),
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
    )


def _special_tokens(
    folder: Path, config: dict, backend: Tokenizer
) -> tuple[dict[str, str | AddedToken], list[str | AddedToken], dict[int, AddedToken]]:
    """The special tokens by name (bos_token ... and the model's own *_token names), the extra
    special tokens, and the added tokens by id, as transformers reads them from the folder: its
    PreTrainedTokenizerBase._from_pretrained and __init__ and TokenizersBackend.__init__, step by step."""
    init = dict(config)
    init.pop("tokenizer_class", None)
    init.pop("add_bos_token", None)  # dropped where tokenizer.json is read
    init.pop("add_eos_token", None)
    if "additional_special_tokens" in init and not init.get("extra_special_tokens"):
        init["extra_special_tokens"] = init.pop("additional_special_tokens")
    model_specific = {
        key: init.pop(key)
        for key in list(init)
        if key not in NAMED_SPECIAL_TOKENS and key.endswith("_token") and isinstance(init[key], str)
    }
    if isinstance(init.get("extra_special_tokens"), dict):
        model_specific.update(init.pop("extra_special_tokens"))
    added: dict[int, AddedToken] = {}
    if "added_tokens_decoder" in init:
        for index, token in init["added_tokens_decoder"].items():
            if not isinstance(token, dict):
                raise ValueError(f"tokenizer_config.json: added_tokens_decoder[{index}] must be a token's fields")
            added[int(index)] = AddedToken(**token)
    else:
        # Older folders: special_tokens_map.json and added_tokens.json, then tokenizer.json's tokens.
        for key, value in (_read_json(folder / "special_tokens_map.json") or {}).items():
            if isinstance(value, dict) and key != "extra_special_tokens":
                value.pop("special", None)
                value = AddedToken(**value, special=True)
            elif key == "extra_special_tokens" and isinstance(value, list):
                merged = list(init.get("extra_special_tokens") or [])
                for token in value:
                    token = AddedToken(**token, special=True) if isinstance(token, dict) else token
                    if token not in merged:
                        merged.append(token)
                value = merged
            init[key] = value
        if isinstance(init.get("extra_special_tokens"), dict):
            model_specific.update(init.pop("extra_special_tokens"))
        added_tokens_file = _read_json(folder / "added_tokens.json")
        if added_tokens_file is not None:
            specials = {str(init[key]) for key in NAMED_SPECIAL_TOKENS if init.get(key)}
            specials.update(str(token) for token in init.get("extra_special_tokens") or [])
            for content, index in added_tokens_file.items():
                is_special = content in specials
                added[index] = AddedToken(
                    content, rstrip=False, lstrip=False, normalized=not is_special, special=is_special
                )
        for serialized in json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]:
            index = serialized.pop("id")
            added[index] = AddedToken(**serialized)
    init.pop("added_tokens_decoder", None)
    init = _added_token_objects(init)
    # A padding in tokenizer.json names the pad token where the config does not.
    if backend.padding is not None:
        init.setdefault("pad_token", backend.padding["pad_token"])

    # What PreTrainedTokenizerBase.__init__ makes of them.
    if "additional_special_tokens" in init and "extra_special_tokens" not in init:
        init["extra_special_tokens"] = init.pop("additional_special_tokens")
    named: dict[str, str | AddedToken | None] = dict.fromkeys(NAMED_SPECIAL_TOKENS)
    extra: list[str | AddedToken] = []
    found_model_specific = {}
    for key, value in init.items():
        if key in NAMED_SPECIAL_TOKENS:
            if value is not None:
                named[key] = _token_value(key, value)
        elif key == "extra_special_tokens":
            if isinstance(value, dict):
                named.update({name: _token_value(name, token) for name, token in value.items()})
            elif isinstance(value, (list, tuple)):
                extra = list(value)
            elif value is not None:
                raise ValueError("tokenizer_config.json: extra_special_tokens must be a list or a dict of tokens")
        elif key.endswith("_token") and isinstance(value, (str, AddedToken)):
            found_model_specific[key] = value
    for name, token in {**found_model_specific, **model_specific}.items():
        named[name] = _token_value(name, token)
    return {key: value for key, value in named.items() if value is not None}, extra, added


def _add_tokens(
    backend: Tokenizer, named: dict[str, str | AddedToken], extra: list[str | AddedToken], added: dict[int, AddedToken]
) -> None:
    """TokenizersBackend.__init__'s adding of tokens: every added token read from the folder
    (transformers looks for them among the backend's by a key that never matches, so it adds them
    all again: a no-op for those tokenizer.json holds alike), then each special token that is not an
    added token yet."""
    to_add: list[str | AddedToken] = [token for _, token in sorted(added.items(), key=lambda item: item[0])]
    known = [token.content for token in backend.get_added_tokens_decoder().values()] + [str(t) for t in to_add]
    for token in [*named.values(), *extra]:
        if str(token) not in known:
            to_add.append(token)
    named_contents = {str(token) for token in named.values() if token}
    tokens = []
    for token in to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and str(token) in named_contents:
            token.special = True
        tokens.append(token)
    if tokens:
        backend.add_tokens(tokens)


def _token_value(key: str, value: Any) -> str | AddedToken:
    if not isinstance(value, (str, AddedToken)):
        raise ValueError(f"tokenizer_config.json: {key} must be a token (a string), not {value!r}")
    return value


def _added_token_objects(value: Any) -> Any:
    """transformers' convert_added_tokens: {"__type": "AddedToken", ...} entries as AddedToken."""
    if isinstance(value, dict) and value.get("__type") == "AddedToken":
        fields = dict(value)
        fields.pop("__type")
        return AddedToken(**fields)
    if isinstance(value, (list, tuple)):
        return [_added_token_objects(item) for item in value]
    if isinstance(value, dict):
        return {key: _added_token_objects(item) for key, item in value.items()}
    return value


def _chat_template(folder: Path, config: dict) -> str | dict[str, str] | None:
    """The folder's chat template as transformers reads it: chat_template.jinja (named "default")
    and each additional_chat_templates/NAME.jinja, one template as a string and several as a dict;
    else tokenizer_config.json's chat_template (a list of named templates becomes a dict)."""
    templates = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        templates.update({path.stem: path.read_text(encoding="utf-8") for path in sorted(extra.glob("*.jinja"))})
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = config.get("chat_template")
    if isinstance(template, (list, tuple)):
        return {entry["name"]: entry["template"] for entry in template}
    return template


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))
