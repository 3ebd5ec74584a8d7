"""Chat templates render as transformers renders them (text and ids), from every place a
checkpoint keeps one; a template's raise_exception is a ChatTemplateError; no template: None."""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve.models.chat_template import ChatTemplateError, load_chat_template
from pdserve.models.checkpoint import open_checkpoint

CHATML = ("{{ bos_token }}{% for message in messages %}"
          "{% if loop.index0 == 0 and message['role'] != 'system' and false %}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
STRICT = ("{% for message in messages %}{% if (message['role'] == 'user') != "
          "(loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate user/assistant') }}"
          "{% endif %}{{ '[' + message['role'] + '] ' + message['content'] | trim }}\n"
          "{% endfor %}{{ eos_token if not add_generation_prompt else '' }}")
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi — ünïcode"},
     {"role": "assistant", "content": "Hey."}, {"role": "user", "content": "More?"}],
]


def _checkpoint(tmp_path, tiny_dir, template=None, jinja_file=None):
    folder = tmp_path / "ckpt"
    folder.mkdir(parents=True)
    shutil.copy(tiny_dir / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja_file is not None:
        (folder / "chat_template.jinja").write_text(jinja_file)
    return folder


@pytest.mark.parametrize("where", ["config", "named_list", "jinja_file"])
def test_renders_like_transformers(tmp_path, tiny_dir, where):
    from transformers import AutoTokenizer

    template = {"config": CHATML, "named_list": [{"name": "default", "template": CHATML},
                                                 {"name": "tool_use", "template": "x"}],
                "jinja_file": None}[where]
    folder = _checkpoint(tmp_path, tiny_dir, template, CHATML if where == "jinja_file" else None)
    tokenizer = open_checkpoint(folder).tokenizer()
    ours = load_chat_template(folder, tokenizer)
    theirs = AutoTokenizer.from_pretrained(folder)
    for messages in CONVERSATIONS:
        for add in (True, False):
            text = ours.render(messages, add)
            assert text == theirs.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add)
            ids = tokenizer.encode(text, add_special_tokens=False)
            expected = theirs.apply_chat_template(messages, tokenize=True,
                                                  add_generation_prompt=add)
            expected = expected["input_ids"] if hasattr(expected, "keys") else expected
            assert ids == list(expected)
    assert text.startswith("<s>")


def test_raise_exception_and_missing_template(tmp_path, tiny_dir):
    folder = _checkpoint(tmp_path, tiny_dir, STRICT)
    template = load_chat_template(folder, open_checkpoint(folder).tokenizer())
    assert template.render(CONVERSATIONS[0], False) == "[user] Hello there\n</s>"
    with pytest.raises(ChatTemplateError, match="alternate"):
        template.render([{"role": "assistant", "content": "first"}])
    assert load_chat_template(tiny_dir, open_checkpoint(tiny_dir).tokenizer()) is None
    with pytest.raises(ValueError, match="compile"):
        load_chat_template(_checkpoint(tmp_path / "b", tiny_dir, "{% for %}"))


def test_the_sandbox_holds(tmp_path, tiny_dir):
    hostile = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    template = load_chat_template(_checkpoint(tmp_path, tiny_dir, hostile))
    with pytest.raises(ChatTemplateError):
        template.render(CONVERSATIONS[0])
