"""Chat templates (models/chat_template.py) against transformers' `apply_chat_template`.

The tokenizers and both templates are written here: a LLaMA-3-style template (BOS in
the text, header tokens, `| trim`) and a ChatML one (Qwen-style `<|im_start|>`, a default
system message, block tags on their own lines, which only render right with trim_blocks
and lstrip_blocks, `tojson`, `namespace`, a `tools is not none` test and
`raise_exception`).
"""

import pytest

from pipe_rlhf_jax.models.chat_template import ChatTemplateError
from pipe_rlhf_jax.models.tokenizer import ByteTokenizer, HFTokenizer
from tests.helpers.hf_helpers import write_chat_tokenizer

transformers = pytest.importorskip("transformers")

LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|finetune_right_pad_id|>"]

CHATML = """{% if messages[0]['role'] == 'system' %}
{% set system = messages[0]['content'] %}
{% set turns = messages[1:] %}
{% else %}
{% set system = 'You are a helpful assistant.' %}
{% set turns = messages %}
{% endif %}
{% if tools is not none %}
{{ raise_exception('this template takes no tools') }}
{% endif %}
{% set ns = namespace(users=0) %}
<|im_start|>system
{{ system }}<|im_end|>
{% for message in turns %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}
    {% endif %}
    {% if message['role'] == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}
<|im_start|>{{ message['role'] }}
{% if message['name'] is defined %}
{{ message['name'] | tojson }}:
{% endif %}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CORPUS = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,:;?!'\"<>&/+-*="
          "()[]{}\\$#\n é")

CONVERSATIONS = {
    "system_user": [{"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": "What is 7 times 8?"}],
    "multi_turn": [{"role": "system", "content": "  Be exact. "},
                   {"role": "user", "content": "What is 1/2 as a decimal?"},
                   {"role": "assistant", "content": "0.5"},
                   {"role": "user", "content": "And 3/4? Use \\boxed{}."}],
    "user_only": [{"role": "user", "content": "Is 9 > 4 & 2 < 3?", "name": "Zoé <x>"}],
}


def _tokenizer(tmp_path, style: str, *, template_file: bool = False):
  path = str(tmp_path / style)
  if style == "llama3":
    write_chat_tokenizer(path, CORPUS, LLAMA3_SPECIALS, eos="<|eot_id|>",
                         bos="<|begin_of_text|>", pad="<|finetune_right_pad_id|>",
                         chat_template=LLAMA3, template_file=template_file)
  else:
    write_chat_tokenizer(path, CORPUS, CHATML_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>",
                         chat_template=CHATML, template_file=template_file)
  return path


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_ids_and_text_equal_transformers(tmp_path, style):
  path = _tokenizer(tmp_path, style)
  ours = HFTokenizer(path)
  theirs = transformers.AutoTokenizer.from_pretrained(path)
  for name, messages in CONVERSATIONS.items():
    if style == "llama3":  # this template prints no names
      messages = [{k: v for k, v in m.items() if k != "name"} for m in messages]
    for generation_prompt in (True, False):
      expected = theirs.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                            tokenize=True, return_dict=False)
      ids = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt)
      assert ids == list(expected), (name, generation_prompt)
      text = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                      tokenize=False)
      assert text == theirs.apply_chat_template(
          messages, add_generation_prompt=generation_prompt, tokenize=False)
      assert text.endswith("assistant<|end_header_id|>\n\n" if style == "llama3" else
                           "<|im_start|>assistant\n") == generation_prompt
  if style == "llama3":
    ids = ours.apply_chat_template(CONVERSATIONS["system_user"])
    # The template writes BOS; nothing adds a second one.
    assert ids[0] == ours.bos_id and ids.count(ours.bos_id) == 1
  else:
    text = ours.apply_chat_template(CONVERSATIONS["user_only"], tokenize=False)
    # Plain JSON: no HTML escaping of <, >, and é kept as it is.
    assert '"Zoé <x>":' in text and text.startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")


def test_template_file_wins_over_the_config_entry(tmp_path):
  path = _tokenizer(tmp_path, "chatml", template_file=True)
  # A stale entry in tokenizer_config.json: transformers reads chat_template.jinja.
  import json
  config_path = f"{path}/tokenizer_config.json"
  with open(config_path) as f:
    config = json.load(f)
  config["chat_template"] = "{{ 'stale' }}"
  with open(config_path, "w") as f:
    json.dump(config, f)
  ours = HFTokenizer(path)
  theirs = transformers.AutoTokenizer.from_pretrained(path)
  messages = CONVERSATIONS["multi_turn"]
  assert ours.chat_template == CHATML
  assert ours.apply_chat_template(messages) == list(
      theirs.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def test_raise_exception_in_a_template_is_a_clear_error(tmp_path):
  path = _tokenizer(tmp_path, "chatml")
  tok = HFTokenizer(path)
  two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
  with pytest.raises(ChatTemplateError, match="roles must alternate") as info:
    tok.apply_chat_template(two_users)
  assert "tokenizer_config.json" in str(info.value)  # where the template came from
  llama = HFTokenizer(_tokenizer(tmp_path, "llama3"))
  with pytest.raises(ValueError, match="Unknown role: robot"):
    llama.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_missing_or_broken_template_names_the_directory_and_fix(tmp_path):
  path = str(tmp_path / "plain")
  write_chat_tokenizer(path, CORPUS, ["</s>"], eos="</s>")
  tok = HFTokenizer(path)
  assert tok.chat_template is None
  with pytest.raises(ValueError, match="has no chat template") as info:
    tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert path in str(info.value) and "{'prompt': text}" in str(info.value)
  with pytest.raises(ValueError, match="byte tokenizer has no chat template"):
    ByteTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
  broken = str(tmp_path / "broken")
  write_chat_tokenizer(broken, CORPUS, ["</s>"], eos="</s>",
                       chat_template="{% for m in messages %}{{ m.content }}",
                       template_file=True)
  tok = HFTokenizer(broken)  # compiled on first use: plain-text users never see it
  assert tok.encode("hi") == tok.encode("hi")
  with pytest.raises(ChatTemplateError, match="does not compile") as info:
    tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert "chat_template.jinja" in str(info.value)
