"""quilld/index/chat_render.py against the token ids vLLM 0.33's own renderer feeds its engine (issue 30).

tests/fixtures/chat_render/ holds tokenizer directories built by tools/make_chat_render_fixtures.py
(a small trained BPE with the Llama 3.1 and Qwen 2.5 instruct families' published chat templates)
and cases.json, the token ids vLLM's HfRenderer and transformers' apply_chat_template produced for
each conversation and completions prompt. Nothing of vLLM or transformers is imported here.
"""

from __future__ import annotations

import json
import shutil
import threading
from datetime import datetime
from pathlib import Path

import pytest

from quilld.index import chat_render
from quilld.index.chat_render import NotCovered, TemplateRejected, TemplateUnavailable

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_render"
CASES = json.loads((FIXTURES / "cases.json").read_text(encoding="utf-8"))


def test_the_fixtures_come_from_vllm_033_and_cover_both_families_and_both_template_sources():
    assert CASES["made_by"]["vllm"].startswith("0.33.")
    assert {c["dir"] for c in CASES["chat"]} == {"llama31", "qwen25", "qwen25_jinja", "environment_rules"}
    assert (FIXTURES / "qwen25_jinja" / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((FIXTURES / "qwen25_jinja" / "tokenizer_config.json").read_text())
    options = [c["options"] for c in CASES["chat"]]
    assert {"add_generation_prompt": False} in options and {} in options
    assert any(o.get("continue_final_message") for o in options)
    assert set(CASES["content_format"].values()) == {"string", "openai"}


@pytest.mark.parametrize("case", CASES["chat"], ids=lambda c: f"{c['dir']}-{c['name']}")
def test_a_chat_renders_to_vllms_text_and_token_ids(case):
    tok = chat_render.load(FIXTURES / case["dir"])
    assert tok.render(case["messages"], **case["options"]) == case["text"]
    assert tok.chat_token_ids(case["messages"], **case["options"]) == case["token_ids"]


@pytest.mark.parametrize("case", CASES["completion"], ids=lambda c: f"{c['dir']}-{c['name']}")
def test_a_completions_prompt_tokenizes_to_vllms_ids(case):
    assert chat_render.load(FIXTURES / case["dir"]).prompt_token_ids(case["prompt"]) == case["token_ids"]


def test_the_llama_chat_starts_with_one_bos_and_a_completion_gets_one_from_the_post_processor():
    tok = chat_render.load(FIXTURES / "llama31")
    bos = tok.tokenizer.token_to_id("<|begin_of_text|>")
    ids = tok.chat_token_ids([{"role": "user", "content": "hi"}])
    assert ids[0] == bos and ids.count(bos) == 1
    assert tok.prompt_token_ids("hi")[0] == bos and tok.prompt_token_ids("hi", add_special_tokens=False)[0] != bos


def test_a_directory_is_loaded_once_and_can_be_used_from_threads():
    first = chat_render.load(FIXTURES / "qwen25")
    assert chat_render.load(str(FIXTURES / "qwen25") + "/") is first
    msgs = [{"role": "user", "content": "same words " * 50}]
    want = first.chat_token_ids(msgs)
    got: list[list[int]] = []
    threads = [threading.Thread(target=lambda: got.append(first.chat_token_ids(msgs))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert got == [want] * 4


def test_named_templates_in_the_config_use_default_and_strftime_now_is_todays_date(tmp_path):
    shutil.copy(FIXTURES / "qwen25" / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ strftime_now('%Y-%m-%d') }} {{ messages[0].content }}"}]}))
    before = datetime.now().strftime("%Y-%m-%d")
    text = chat_render.load(tmp_path).render([{"role": "user", "content": "x"}])
    assert text in (f"{before} x", f"{datetime.now().strftime('%Y-%m-%d')} x")


@pytest.mark.parametrize("name", sorted(CASES["content_format"]))
def test_a_template_vllm_hands_content_parts_to_is_refused_and_the_families_are_not(name):
    source = (FIXTURES / "templates" / name).read_text(encoding="utf-8")
    assert chat_render.walks_content_parts(source) == (CASES["content_format"][name] == "openai")


def test_chats_for_a_content_parts_template_are_not_covered_but_completions_are(tmp_path):
    shutil.copy(FIXTURES / "qwen25" / "tokenizer.json", tmp_path / "tokenizer.json")
    shutil.copy(FIXTURES / "templates" / "openai_parts.jinja", tmp_path / "chat_template.jinja")
    tok = chat_render.load(tmp_path)
    with pytest.raises(NotCovered, match="content parts"):
        tok.chat_token_ids([{"role": "user", "content": "x"}])
    assert tok.prompt_token_ids("x") == chat_render.load(FIXTURES / "qwen25").prompt_token_ids("x")


def test_a_directory_without_a_template_says_so(tmp_path):
    shutil.copy(FIXTURES / "qwen25" / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(TemplateUnavailable, match=r"no chat template \(neither chat_template.jinja nor"):
        chat_render.load(tmp_path)


def test_a_directory_without_tokenizer_json_says_so(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    with pytest.raises(TemplateUnavailable, match="no tokenizer.json"):
        chat_render.load(tmp_path)


def test_a_broken_template_is_refused_at_load_with_its_line(tmp_path):
    shutil.copy(FIXTURES / "qwen25" / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}\n{{ m.content }}\n")
    with pytest.raises(TemplateUnavailable, match=r"default chat template does not compile: .*'endfor'.* \(line 2\)") as e:
        chat_render.load(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_an_unreadable_config_is_named(tmp_path):
    shutil.copy(FIXTURES / "qwen25" / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TemplateUnavailable, match="tokenizer_config.json"):
        chat_render.load(tmp_path)


def test_the_templates_raise_exception_reaches_the_caller_as_a_rejection():
    tok = chat_render.load(FIXTURES / "llama31")
    two_calls = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"type": "function", "function": {"name": "g", "arguments": "{}"}}]}
    with pytest.raises(TemplateRejected, match="only supports single tool-calls"):
        tok.render([{"role": "user", "content": "x"}, two_calls])


def test_raise_exception_carries_the_templates_message():
    tok = chat_render.load(FIXTURES / "environment_rules")
    with pytest.raises(TemplateRejected, match="the chat template rejected the request: no boom: user"):
        tok.render([{"role": "user", "content": "boom"}])


def test_a_template_that_fails_on_the_request_rejects_it_with_the_reason(tmp_path):
    shutil.copy(FIXTURES / "qwen25" / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content + 1 }}")
    with pytest.raises(TemplateRejected, match="rejected the request: .*str"):
        chat_render.load(tmp_path).render([{"role": "user", "content": "x"}])


def test_the_sandbox_refuses_what_transformers_refuses(tmp_path):
    shutil.copy(FIXTURES / "qwen25" / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}{% set ns = namespace() %}"
                                                  "{% set ns._x = 1 %}")
    with pytest.raises(TemplateRejected):
        chat_render.load(tmp_path).render([{"role": "user", "content": "x"}])


def test_requests_it_does_not_reproduce_are_refused_not_guessed():
    tok = chat_render.load(FIXTURES / "qwen25")
    with pytest.raises(NotCovered, match="image_url"):
        tok.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    with pytest.raises(TemplateRejected, match="both"):
        tok.render([{"role": "user", "content": "x"}], add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(TemplateRejected, match="tokenize"):
        tok.render([{"role": "user", "content": "x"}], chat_template_kwargs={"tokenize": False})
    with pytest.raises(TemplateRejected, match="non-empty list"):
        tok.render([])
    for key in ("tools", "documents"):
        with pytest.raises(NotCovered, match=key):
            tok.chat_token_ids([{"role": "user", "content": "x"}], chat_template_kwargs={key: [{"a": 1}]})
