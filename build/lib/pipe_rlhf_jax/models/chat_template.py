"""Chat templates: a Hugging Face model's conversation format, rendered as transformers does.

A chat model's tokenizer directory carries a Jinja template that turns a list of
messages ({"role": "system" | "user" | "assistant" | "tool", "content": str}) into the
exact text the model was trained on: ChatML's `<|im_start|>user ... <|im_end|>`,
LLaMA-3's `<|start_header_id|>user<|end_header_id|> ... <|eot_id|>`, and so on. The
template is looked up the way transformers loads it: a `chat_template.jinja` file in the
directory wins over the `chat_template` entry of `tokenizer_config.json` (a string, or a
list of {"name", "template"} of which "default" is used).

Rendering uses Jinja2 (the library transformers uses, so the text is byte-identical, and
a well-kept sandbox for templates that come from model hubs) with transformers' settings
(documented behaviour of `PreTrainedTokenizerBase.apply_chat_template`, transformers
5.x):

* an immutable sandboxed environment with `trim_blocks` and `lstrip_blocks` and the
  `loopcontrols` extension (`{% break %}`, `{% continue %}`);
* the globals `raise_exception(message)` (the template refuses a conversation: surfaces
  here as `ChatTemplateError`) and `strftime_now(format)` (today's date, for templates
  that print it), beside Jinja's own (`namespace`, `range`, `dict`, ...), whose
  attributes starting with "_" the sandbox never lets a template read;
* a `tojson` filter that writes plain `json.dumps` (no HTML escaping; `indent`,
  `separators`, `sort_keys` and `ensure_ascii` accepted);
* the variables `messages`, `add_generation_prompt`, `tools=None`, `documents=None`
  (defined and None, not undefined: `{% if tools is not none %}` is false) and the
  tokenizer's named special tokens as strings (`bos_token`, `eos_token`, `unk_token`,
  `sep_token`, `pad_token`, `cls_token`, `mask_token`, those the tokenizer names).

Message keys whose value is None are dropped before rendering (templates handle a
missing key, not a "None"), as transformers does. The rendered text usually begins with
the BOS token itself; `models.tokenizer.HFTokenizer.apply_chat_template` encodes it
without adding specials, so the ids equal transformers'.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Mapping, Sequence

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# The named special tokens a template sees as variables (transformers' attribute names).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class ChatTemplateError(ValueError):
  """A template that does not compile, or refused a conversation (`raise_exception`)."""


def find_chat_template(directory: str) -> tuple[str, str] | None:
  """The chat template of a tokenizer directory and the file it came from, or None.

  Raises:
    ChatTemplateError: `tokenizer_config.json` holds named templates but none "default".
  """
  jinja_path = os.path.join(directory, TEMPLATE_FILE)
  if os.path.isfile(jinja_path):
    with open(jinja_path, encoding="utf-8") as f:
      return f.read(), jinja_path
  config_path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(config_path):
    return None
  with open(config_path, encoding="utf-8") as f:
    try:
      template = json.load(f).get("chat_template")
    except (json.JSONDecodeError, AttributeError):
      return None
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
    if "default" not in named:
      raise ChatTemplateError(
          f"{config_path}: chat_template lists the templates {sorted(map(str, named))} but "
          "none named 'default'; add a 'default' entry or a chat_template.jinja file.")
    template = named["default"]
  if not isinstance(template, str) or not template:
    return None
  return template, config_path


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


def _raise_exception(message: str):
  import jinja2
  raise jinja2.exceptions.TemplateError(message)


class ChatTemplate:
  """A compiled chat template with the special tokens it renders.

  Args:
    source: the Jinja template text.
    special_tokens: named special tokens ("bos_token" -> "<s>", ...) visible as variables.
    origin: where the template came from, for messages (a file path).

  Raises:
    ChatTemplateError: the template does not compile (the message names `origin`).
  """

  def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None,
               origin: str = "chat template"):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    self.source = source
    self.origin = origin
    self.special_tokens = dict(special_tokens or {})
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
      self._template = env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
      raise ChatTemplateError(f"{origin}: the chat template does not compile (template line "
                              f"{e.lineno}: {e.message}).") from e

  def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
             ) -> str:
    """The conversation as the model reads it.

    Args:
      messages: dicts with at least "role" and "content".
      add_generation_prompt: end with the header of a new assistant turn, so that what
        the model generates next is the assistant's answer.

    Raises:
      ChatTemplateError: the template refused the conversation (`raise_exception`) or
        failed while rendering it.
    """
    import jinja2
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
      raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}.")
    chat = []
    for i, message in enumerate(messages):
      if not isinstance(message, Mapping):
        raise TypeError(f"messages[{i}] is a {type(message).__name__}, not a dict.")
      chat.append({k: v for k, v in message.items() if v is not None})
    try:
      return self._template.render(messages=chat, tools=None, documents=None,
                                   add_generation_prompt=bool(add_generation_prompt),
                                   **self.special_tokens)
    except jinja2.exceptions.TemplateError as e:
      raise ChatTemplateError(f"{self.origin}: the chat template raised on this "
                              f"conversation: {e}") from e
