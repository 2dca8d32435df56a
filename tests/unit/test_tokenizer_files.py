"""A model folder's tokenizer read without transformers equals what transformers' AutoTokenizer
builds from the same folder, for the packaged models and for folders that exercise every way of
naming added and special tokens; folders it cannot read so go to AutoTokenizer; and the gateway
loads its tokenizer without importing transformers or torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.chat_format import get_chat_format
from gateway.conversation import Conversation, Message, ToolSpec
from polar.inference.models import ALIASES, resolve_model
from polar.inference.tokenizer_files import (
    OWN_CLASS_MODEL_TYPES,
    FileTokenizer,
    load_tokenizer,
    read_tokenizer_files,
)

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": 'Héllo <|im_end|> wörld, 你好 🙂\n\n  {"a": [1, 2]}'},
    {"role": "assistant", "content": "<think>hm</think>\tDone."},
    {"role": "user", "content": "Again?"},
]
ORDINARY_TOKENS = ("hello", "Ġthe", "Ċ", "<|im", "not-a-token-at-all")
# Texts the engine encodes and decodes (forced replies, prompt windows), spaced before punctuation
# and contractions as transformers' clean-up would join them.
TEXTS = (
    "Done.",
    '<tool_call>\n{"name": "bash"} </tool_call><|im_end|>',
    "Is it ? yes , it is n't : they 're here ' s . Héllo wörld 你好 🙂",
    "<|im_start|>user\nHi<|im_end|>\n",
)
# Models whose folders build slowly the first time (smollm2-135m de-quantizes its GGUF weights).
SLOW_TO_BUILD = ("smollm2-135m",)


@pytest.fixture(scope="module")
def auto_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer


def assert_same_tokenizer(light: FileTokenizer, hf) -> None:
    """`light` answers as `hf` does to everything the gateway and the torch engine ask of a tokenizer."""
    assert light.backend_tokenizer.to_str() == hf.backend_tokenizer.to_str()
    assert light.backend_tokenizer.encode_special_tokens == hf.backend_tokenizer.encode_special_tokens
    assert light.unk_token_id == hf.unk_token_id
    assert (light.bos_token_id, light.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert light.chat_template == hf.chat_template
    assert light.get_vocab() == hf.get_vocab() and len(light) == len(hf)
    tokens = [token.content for token in hf.added_tokens_decoder.values()] + hf.all_special_tokens
    for token in [*tokens, *ORDINARY_TOKENS]:
        assert light.convert_tokens_to_ids(token) == hf.convert_tokens_to_ids(token), token
    for text in [*TEXTS, " ".join(tokens)]:
        for special in (True, False):
            ids = light.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize(
    "alias", [pytest.param(a, marks=pytest.mark.slow) if a in SLOW_TO_BUILD else a for a in ALIASES]
)
def test_a_packaged_models_tokenizer_is_the_one_transformers_loads(alias, auto_tokenizer):
    folder = resolve_model(alias)
    light, hf = read_tokenizer_files(folder), auto_tokenizer.from_pretrained(folder)
    assert isinstance(light, FileTokenizer)
    assert_same_tokenizer(light, hf)
    text = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert light.backend_tokenizer.encode(text).ids == hf(text)["input_ids"]
    # The gateway's chat format renders the same ids over either.
    tool = ToolSpec("f", "Does f.", {"type": "object", "properties": {"x": {"type": "string"}}})
    conversation = Conversation(tuple(Message(m["role"], m["content"]) for m in CHAT), (tool,))
    light_format, hf_format = get_chat_format("hermes", light), get_chat_format("hermes", hf)
    assert light_format.render_prompt(conversation) == hf_format.render_prompt(conversation)
    assert light_format.generation_prompt() == hf_format.generation_prompt()


def tokenizer_folder(
    tmp_path: Path,
    config_changes: dict,
    files: dict | None = None,
    tokenizer_json=None,
    raw_files: dict | None = None,
    remove: list[str] | None = None,
) -> Path:
    """A copy of the tiny model's tokenizer folder with its tokenizer_config.json changed
    (a None value removes the key), other files added (JSON `files`, text `raw_files`), files
    removed, and tokenizer.json rewritten by a function."""
    source = resolve_model("tiny")
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in (files or {}).items():
        (folder / name).write_text(json.dumps(content))
    for name, content in (raw_files or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(content)
    for name in remove or []:
        (folder / name).unlink()
    if tokenizer_json is not None:
        serialized = json.loads((folder / "tokenizer.json").read_text())
        tokenizer_json(serialized)
        (folder / "tokenizer.json").write_text(json.dumps(serialized))
    return folder


def added(content: str, **flags) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False} | flags


def word_level_model(serialized: dict) -> None:
    """A word-level model over the same vocabulary, split on whitespace (its decoder joins with spaces)."""
    serialized["model"] = {"type": "WordLevel", "vocab": serialized["model"]["vocab"], "unk_token": "<|endoftext|>"}
    serialized["pre_tokenizer"] = {"type": "WhitespaceSplit"}
    serialized["decoder"] = None
    serialized["normalizer"] = None


def no_post_processor_and_a_padding(serialized: dict) -> None:
    serialized["post_processor"] = None
    serialized["padding"] = {
        "strategy": "BatchLongest",
        "direction": "Left",
        "pad_to_multiple_of": None,
        "pad_id": 49152,
        "pad_type_id": 0,
        "pad_token": "<pad>",
    }


FOLDERS = {
    # Added tokens in tokenizer_config.json: one new, one tokenizer.json holds with other flags.
    "added_tokens_decoder": dict(
        config_changes={
            "added_tokens_decoder": {
                "49152": added("<tool_call>", special=False, normalized=True),
                "3": added("<repo_name>", special=False, lstrip=True),
                "0": added("<|endoftext|>", special=True),
            },
            "bos_token": "<tool_call>",
        }
    ),
    # Special tokens the vocabulary lacks: extra ones, a model's own names, a new unknown token.
    "special_tokens": dict(
        config_changes={
            "extra_special_tokens": ["<extra_a>", "<|im_end|>"],
            "image_token": "<image>",
            "unk_token": "<unk>",
            "mask_token": {"__type": "AddedToken", **added("<mask>", special=True)},
        }
    ),
    "named_extra_special_tokens": dict(
        config_changes={
            "extra_special_tokens": {"audio_token": "<audio>"},
            "image_token": "<image>",
            "added_tokens_decoder": {},
        }
    ),
    "additional_special_tokens": dict(
        config_changes={"additional_special_tokens": ["<extra_b>"]}, files={"added_tokens.json": {"<extra_b>": 49152}}
    ),
    # Folders saved before added_tokens_decoder: special_tokens_map.json and added_tokens.json.
    "legacy_files": dict(
        config_changes={"unk_token": None, "bos_token": None},
        files={
            "special_tokens_map.json": {
                "bos_token": added("<|im_start|>", normalized=True, special=False),
                "unk_token": "<|endoftext|>",
                "additional_special_tokens": ["<legacy_special>", "<legacy_extra>"],
                "sep_token": "<sep>",
            },
            "added_tokens.json": {"<legacy_added>": 49152, "<legacy_special>": 49153, "<sep>": 49154},
        },
    ),
    "legacy_extra_special_tokens": dict(
        config_changes={"extra_special_tokens": ["<extra_c>"]},
        files={"special_tokens_map.json": {"extra_special_tokens": [added("<extra_d>"), "<extra_c>"]}},
    ),
    "legacy_named_extra_special_tokens": dict(
        config_changes={"image_token": "<image>"},
        files={"special_tokens_map.json": {"extra_special_tokens": {"video_token": "<video>"}}},
    ),
    "no_post_processor_and_a_padding": dict(
        config_changes={"pad_token": None}, tokenizer_json=no_post_processor_and_a_padding
    ),
    "split_special_tokens": dict(config_changes={"split_special_tokens": True, "add_bos_token": True}),
    "older_generic_class": dict(config_changes={"tokenizer_class": "PreTrainedTokenizerFast"}),
    "no_unknown_token": dict(config_changes={"unk_token": None}),
    # transformers' clean-up of decoded text: skipped for BPE (this tokenizer's model), applied to others.
    "clean_up_spaces_bpe": dict(config_changes={"clean_up_tokenization_spaces": True}),
    "clean_up_spaces_word_level": dict(
        config_changes={"clean_up_tokenization_spaces": True}, tokenizer_json=word_level_model
    ),
    # Chat templates: the config's (a string, or named ones), the file's, several files'.
    "config_chat_template": dict(config_changes={"chat_template": "{{ messages }}"}, remove=["chat_template.jinja"]),
    "named_config_chat_templates": dict(
        config_changes={"chat_template": [{"name": "default", "template": "a"}, {"name": "tool_use", "template": "b"}]},
        remove=["chat_template.jinja"],
    ),
    "file_over_config_chat_template": dict(config_changes={"chat_template": "{{ ignored }}"}),
    "additional_chat_templates": dict(
        config_changes={}, raw_files={"additional_chat_templates/tool_use.jinja": "{{ tools }}"}
    ),
    "no_chat_template": dict(config_changes={}, remove=["chat_template.jinja"]),
}


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_a_folders_added_and_special_tokens_merge_as_transformers_merges_them(name, tmp_path, auto_tokenizer):
    folder = tokenizer_folder(tmp_path, **FOLDERS[name])
    light, hf = read_tokenizer_files(folder), auto_tokenizer.from_pretrained(folder)
    assert isinstance(light, FileTokenizer)
    assert_same_tokenizer(light, hf)


@pytest.mark.parametrize(
    "config_changes, model_type",
    [
        ({"tokenizer_class": "Qwen2Tokenizer"}, None),  # a class that builds its backend in code
        ({"tokenizer_class": None}, None),  # transformers picks the class by the model type
        ({"auto_map": {"AutoTokenizer": [None, "tok.Tok"]}}, None),  # remote code
        ({"fix_mistral_regex": True}, None),
        ({}, "qwen2"),  # transformers overrides the generic class the folder names
    ],
)
def test_a_folder_transformers_builds_otherwise_is_left_to_it(config_changes, model_type, tmp_path):
    folder = tokenizer_folder(tmp_path, config_changes)
    if model_type is not None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"model_type": model_type}))
    assert read_tokenizer_files(folder) is None


def test_a_folder_without_tokenizer_json_loads_through_auto_tokenizer(tmp_path):
    folder = tokenizer_folder(tmp_path, {"tokenizer_class": "GPT2Tokenizer"})
    # What tokenizer.json's BPE model holds, as vocab.json and merges.txt.
    serialized = json.loads((folder / "tokenizer.json").read_text())
    (folder / "vocab.json").write_text(json.dumps(serialized["model"]["vocab"]))
    merges = serialized["model"]["merges"]
    (folder / "merges.txt").write_text("\n".join(m if isinstance(m, str) else " ".join(m) for m in merges))
    (folder / "tokenizer.json").unlink()
    assert read_tokenizer_files(folder) is None
    tokenizer = load_tokenizer(str(folder))
    assert type(tokenizer).__name__ == "GPT2Tokenizer"
    assert tokenizer.convert_tokens_to_ids("hello") == serialized["model"]["vocab"]["hello"]


def test_the_model_types_transformers_gives_a_class_of_their_own_are_known():
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
        TOKENIZER_MAPPING_NAMES,
    )

    generic = {None, "TokenizersBackend", "PreTrainedTokenizerFast"}
    own_class = {
        model_type
        for model_type in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        if TOKENIZER_MAPPING_NAMES.get(model_type) not in generic
    }
    assert own_class == OWN_CLASS_MODEL_TYPES


def test_the_gateway_and_the_node_load_the_tokenizer_without_transformers_or_torch():
    resolve_model("tiny")  # built here, where importing torch is no cost to what is measured
    program = (
        "import sys\n"
        "import gateway.server, polar.app.node.node\n"
        "from gateway.chat_format import get_chat_format\n"
        "tokenizer = gateway.server._load_tokenizer('tiny', 'tiny')\n"
        "get_chat_format('hermes', tokenizer).render_prompt\n"
        "print(type(tokenizer).__name__, sorted({'transformers', 'torch'} & set(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["FileTokenizer", "[]"]
