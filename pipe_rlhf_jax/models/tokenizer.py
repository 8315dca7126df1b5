"""Tokenizers: the text <-> id contract every data loader and sampler relies on.

Owns one small protocol (`Tokenizer`) and two implementations:

* `ByteTokenizer`: UTF-8 bytes are ids 0..255, then pad=256, bos=257, eos=258. The
  vocabulary is padded to 264 rows (ids 259..263 are reserved and never produced by
  `encode`) so that an embedding sharded over a tensor axis of 2, 4 or 8 divides evenly;
  `models.config.tiny_config` uses the same 264.
* `HFTokenizer`: a local Hugging Face `tokenizer.json` run by the `tokenizers` package,
  with the special-token ids read from the config files that usually sit next to it,
  and the directory's chat template (`models/chat_template.py`, rendered with Jinja2)
  behind `apply_chat_template`, as transformers' tokenizers have it.

`load_tokenizer(spec)` maps a config string ("byte", a directory, or a tokenizer.json
path) to one of them.

Special-token handling is uniform: `encode` never inserts specials except an optional
leading BOS; EOS is appended by whoever builds completions (the data loaders), so that
the layout rules of `ppo/types.py` live in one place. A chat template writes its own
specials (BOS included) into the text, so `apply_chat_template` adds none.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Protocol, Sequence, runtime_checkable

from pipe_rlhf_jax.models import chat_template
from pipe_rlhf_jax.models.checkpoint_files import is_gguf

_log = logging.getLogger(__name__)


@runtime_checkable
class Tokenizer(Protocol):
  """What the rest of the code base needs from a tokenizer.

  Attributes:
    vocab_size: number of ids the model must embed (every produced id is below it).
    pad_id: id used for padding (never attended to; masks mark real tokens).
    bos_id: id prepended to prompts, or None when the model uses no BOS.
    eos_id: id that ends a completion.
  """

  vocab_size: int
  pad_id: int
  bos_id: int | None
  eos_id: int

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    """Text -> ids, no specials except a leading BOS when `add_bos` and one exists."""
    ...

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    """Ids -> text; with `skip_special`, pad/bos/eos (and other specials) are dropped."""
    ...


class ByteTokenizer:
  """UTF-8 byte-level tokenizer with three specials and a vocabulary padded to 264.

  Ids: 0..255 are raw bytes, 256 = pad, 257 = bos, 258 = eos, 259..263 reserved.
  """

  NUM_BYTES = 256
  PAD_ID = 256
  BOS_ID = 257
  EOS_ID = 258
  # 259 real ids rounded up to a multiple of 8, for even tensor-parallel sharding.
  VOCAB_SIZE = 264

  def __init__(self):
    self.vocab_size = self.VOCAB_SIZE
    self.pad_id = self.PAD_ID
    self.bos_id: int | None = self.BOS_ID
    self.eos_id = self.EOS_ID
    self.chat_template = None  # no conversation format: prompts are plain text

  def apply_chat_template(self, messages, add_generation_prompt: bool = True,
                          tokenize: bool = True):
    """Refuses: the byte tokenizer belongs to no chat model, so has no template."""
    del messages, add_generation_prompt, tokenize
    raise ValueError(
        "The byte tokenizer has no chat template, so it cannot render {'messages': [...]} "
        "records: give prompts as {'prompt': text}, or use a Hugging Face tokenizer "
        "directory whose tokenizer_config.json has a chat_template (config.model.tokenizer"
        " or config.model.path).")

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    """Encodes `text` as its UTF-8 bytes, optionally after a BOS id.

    Args:
      text: any Python string.
      add_bos: prepend `bos_id`.

    Returns:
      A list of ids.
    """
    if not isinstance(text, str):
      raise TypeError(f"ByteTokenizer.encode expects str, got {type(text).__name__}.")
    ids = list(text.encode("utf-8"))
    return [self.BOS_ID] + ids if add_bos else ids

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    """Decodes ids; invalid UTF-8 byte runs become U+FFFD rather than raising.

    Args:
      ids: ids below `vocab_size` (any int-like, e.g. a numpy row).
      skip_special: drop pad/bos/eos/reserved ids; otherwise they are rendered as
        "<pad>", "<bos>", "<eos>", "<reserved_N>".

    Returns:
      The decoded string.
    """
    names = {self.PAD_ID: "<pad>", self.BOS_ID: "<bos>", self.EOS_ID: "<eos>"}
    pieces: list[str] = []
    run = bytearray()
    for raw in ids:
      i = int(raw)
      if not 0 <= i < self.vocab_size:
        raise ValueError(f"id {i} is outside the byte vocabulary [0, {self.vocab_size}).")
      if i < self.NUM_BYTES:
        run.append(i)
        continue
      # A special splits the byte stream: decode what came before it on its own.
      if run:
        pieces.append(run.decode("utf-8", errors="replace"))
        run = bytearray()
      if not skip_special:
        pieces.append(names.get(i, f"<reserved_{i}>"))
    if run:
      pieces.append(run.decode("utf-8", errors="replace"))
    return "".join(pieces)


def _token_content(value) -> str | None:
  """A special token from a config: a plain string or an AddedToken-like dict."""
  if isinstance(value, str):
    return value
  if isinstance(value, dict) and isinstance(value.get("content"), str):
    return value["content"]
  return None


def _first_id(value) -> int | None:
  """An id from config.json / generation_config.json: an int, or the first of a list."""
  if isinstance(value, bool):
    return None
  if isinstance(value, int):
    return value
  if isinstance(value, (list, tuple)) and value and isinstance(value[0], int):
    return value[0]
  return None


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"Could not read tokenizer side file {path}: {e}") from e
  return data if isinstance(data, dict) else {}


class HFTokenizer:
  """A Hugging Face `tokenizer.json` with specials resolved from neighbouring configs.

  Special ids are looked up in this order, the first hit winning per token:
  `tokenizer_config.json` and `special_tokens_map.json` (token strings, mapped to ids
  through the vocabulary), then `generation_config.json` and `config.json`
  (`*_token_id`; for a list of EOS ids the first is used). Explicit constructor
  arguments override all of them. A missing pad falls back to EOS (logged), a missing
  BOS stays None, a missing EOS is an error: completions could never end.

  Args:
    path: a directory holding `tokenizer.json`, or the path of the file itself.
    eos_token / bos_token / pad_token: optional token strings overriding the configs.
  """

  _SIDE_FILES_BY_TOKEN = ("tokenizer_config.json", "special_tokens_map.json")
  _SIDE_FILES_BY_ID = ("generation_config.json", "config.json")

  def __init__(
      self,
      path: str,
      *,
      eos_token: str | None = None,
      bos_token: str | None = None,
      pad_token: str | None = None,
  ):
    import tokenizers  # Imported here so the byte tokenizer works without the package.

    path = os.fspath(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
      raise FileNotFoundError(
          f"No tokenizer file at {file!r}: pass a directory containing tokenizer.json, "
          "the path of a tokenizer.json, or 'byte' for the byte tokenizer."
      )
    self.path = file
    self._tok = tokenizers.Tokenizer.from_file(file)
    directory = os.path.dirname(os.path.abspath(file))

    overrides = {"eos": eos_token, "bos": bos_token, "pad": pad_token}
    found: dict[str, int | None] = {"eos": None, "bos": None, "pad": None}
    for kind, token in overrides.items():
      if token is not None:
        found[kind] = self._id_of(token, f"{kind}_token argument")
    for name in self._SIDE_FILES_BY_TOKEN:
      side = os.path.join(directory, name)
      if not os.path.isfile(side):
        continue
      data = _read_json(side)
      for kind in found:
        token = _token_content(data.get(f"{kind}_token"))
        if found[kind] is None and token is not None:
          found[kind] = self._id_of(token, f"{kind}_token in {side}")
    for name in self._SIDE_FILES_BY_ID:
      side = os.path.join(directory, name)
      if not os.path.isfile(side):
        continue
      data = _read_json(side)
      for kind in found:
        value = _first_id(data.get(f"{kind}_token_id"))
        if found[kind] is None and value is not None:
          found[kind] = value

    if found["eos"] is None:
      raise ValueError(
          f"Could not determine the EOS token for {file}: none of "
          f"{self._SIDE_FILES_BY_TOKEN + self._SIDE_FILES_BY_ID} next to it names one. "
          "Add one of those files or pass eos_token=... to HFTokenizer."
      )
    if found["pad"] is None:
      _log.info("Tokenizer %s has no pad token; padding with EOS id %d.", file, found["eos"])
      found["pad"] = found["eos"]

    self.eos_id: int = int(found["eos"])
    self.pad_id: int = int(found["pad"])
    self.bos_id: int | None = None if found["bos"] is None else int(found["bos"])
    ids = [i for i in (self.eos_id, self.pad_id, self.bos_id) if i is not None]
    self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(ids) + 1)
    self._specials = set(ids)
    self.directory = directory
    self._chat_found = chat_template.find_chat_template(directory)
    self._chat_names = self._template_tokens(directory, overrides)
    self._chat: chat_template.ChatTemplate | None = None  # compiled on first use

  def _template_tokens(self, directory: str, overrides: dict[str, str | None]
                       ) -> dict[str, str]:
    """The named special tokens a chat template may print, as strings."""
    # Token strings as the side files name them (first file wins, then the constructor's
    # overrides): a token only config.json names by id is not a template variable in
    # transformers either.
    names: dict[str, str] = {}
    for name in reversed(self._SIDE_FILES_BY_TOKEN):
      side = os.path.join(directory, name)
      if os.path.isfile(side):
        data = _read_json(side)
        for key in chat_template.SPECIAL_TOKEN_NAMES:
          token = _token_content(data.get(key))
          if token is not None:
            names[key] = token
    names.update({f"{kind}_token": token for kind, token in overrides.items()
                  if token is not None})
    return names

  @property
  def chat_template(self) -> str | None:
    """The Jinja source of the directory's chat template, or None without one."""
    return None if self._chat_found is None else self._chat_found[0]

  @property
  def chat_template_origin(self) -> str | None:
    """The file the chat template came from (what messages about it name), or None."""
    return None if self._chat_found is None else self._chat_found[1]

  def apply_chat_template(self, messages, add_generation_prompt: bool = True,
                          tokenize: bool = True):
    """Renders a conversation with the directory's chat template, as transformers does.

    Args:
      messages: a list of {"role", "content", ...} dicts.
      add_generation_prompt: end with the header of an assistant turn, so the model's
        continuation is the assistant's answer (what a prompt for generation needs).
      tokenize: return ids (the rendered text encoded without adding specials: the
        template writes BOS and the turn markers itself); False returns the text.

    Returns:
      A list of ids, or the text with `tokenize=False`.

    Raises:
      ValueError: the directory has no chat template (naming it and the fix), or the
        template raised on the conversation (`chat_template.ChatTemplateError`).
    """
    if self._chat_found is None:
      raise ValueError(
          f"The tokenizer in {self.directory} has no chat template (neither "
          f"{chat_template.TEMPLATE_FILE} nor a chat_template entry in "
          f"{chat_template.CONFIG_FILE}), so it cannot render messages: use the tokenizer "
          "of a chat (instruct) model, add its template to that directory, or give prompts "
          "as plain {'prompt': text}.")
    if self._chat is None:
      source, origin = self._chat_found
      self._chat = chat_template.ChatTemplate(source, self._chat_names, origin=origin)
    text = self._chat.render(messages, add_generation_prompt=add_generation_prompt)
    if not tokenize:
      return text
    return self._tok.encode(text, add_special_tokens=False).ids

  def _id_of(self, token: str, where: str) -> int:
    token_id = self._tok.token_to_id(token)
    if token_id is None:
      raise ValueError(
          f"Special token {token!r} ({where}) is not in the vocabulary of {self.path}.")
    return token_id

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    """Encodes `text` without the tokenizer's own post-processing specials.

    Args:
      text: the string.
      add_bos: prepend `bos_id` (ignored when the tokenizer has no BOS).

    Returns:
      A list of ids.
    """
    if not isinstance(text, str):
      raise TypeError(f"HFTokenizer.encode expects str, got {type(text).__name__}.")
    ids = self._tok.encode(text, add_special_tokens=False).ids
    if add_bos and self.bos_id is not None:
      return [self.bos_id] + ids
    return ids

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    """Decodes ids; with `skip_special`, pad/bos/eos and added special tokens are dropped."""
    ids = [int(i) for i in ids]
    if skip_special:
      ids = [i for i in ids if i not in self._specials]
    return self._tok.decode(ids, skip_special_tokens=skip_special)


def load_tokenizer(spec: str) -> Tokenizer:
  """Builds the tokenizer a config names.

  Args:
    spec: "byte" for `ByteTokenizer`; otherwise a directory containing tokenizer.json
      or the path of a tokenizer.json file; or a `.gguf` file, or a directory holding one
      and no tokenizer.json (the tokenizer its metadata describes, `models/gguf.py`).

  Returns:
    A `Tokenizer`.
  """
  if not isinstance(spec, (str, os.PathLike)) or not os.fspath(spec):
    raise ValueError(f"Tokenizer spec must be 'byte' or a path, got {spec!r}.")
  if os.fspath(spec) == "byte":
    return ByteTokenizer()
  path = os.fspath(spec)
  if is_gguf(path, hf_file="tokenizer.json"):
    raise ValueError(f"{path} is a GGUF checkpoint; load its tokenizer with "
                     "pipe_rlhf_jax.models.load_tokenizer (models/load.py), which reads "
                     "both formats.")
  return HFTokenizer(path)
