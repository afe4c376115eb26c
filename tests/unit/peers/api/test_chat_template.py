"""Chat prompts: the model's own Jinja template from tokenizer_config.json, else the documented fallback."""

from __future__ import annotations

import json

import pytest

from peers.api.chat_template import FALLBACK_STOPS, ChatTemplate

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And now?"}]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_without_a_template_the_fallback_format(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    template = ChatTemplate(tmp_path)
    prompt = template.render(MESSAGES)
    assert not template.has_template
    assert prompt.text == "System: Be brief.\nUser: Hi\nAssistant: Hello.\nUser: And now?\nAssistant:"
    assert prompt.add_special_tokens and prompt.stops == FALLBACK_STOPS


def test_a_folder_without_tokenizer_config_uses_the_fallback(tmp_path):
    assert ChatTemplate(tmp_path).render([{"role": "user", "content": "x"}]).text == "User: x\nAssistant:"


def test_the_models_template_is_used(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    prompt = ChatTemplate(tmp_path).render(MESSAGES[1:2])
    assert prompt.text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert not prompt.add_special_tokens and prompt.stops == ()


def test_special_tokens_and_raise_exception_as_in_transformers(tmp_path):
    source = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
              "{{ raise_exception('no system role') }}{% endif %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
              "{% endfor %}")
    config = {"chat_template": source, "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate(tmp_path)
    assert template.render(MESSAGES[1:2]).text == "<s>[user] Hi</s>"
    with pytest.raises(ValueError, match="no system role"):
        template.render(MESSAGES)


def test_named_templates_and_a_jinja_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert ChatTemplate(tmp_path).render(MESSAGES).text == "D"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert ChatTemplate(tmp_path).render(MESSAGES).text == "J4"


def test_a_template_that_does_not_compile_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(ValueError, match="chat template does not compile"):
        ChatTemplate(tmp_path)
