"""The OpenAI-compatible API driven by the official `openai` client, streaming and not."""
from __future__ import annotations

import httpx
import openai
import pytest

BASE = "SmolLM2-135M-Instruct"


def test_chat_completion_non_streaming(platform):
    t = platform.tenant()
    client = platform.openai(t)
    r = client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "What is 2+2?"}],
                                       max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    assert r.model == BASE
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    [event] = platform.usage_events(t.name)
    assert event.request_id == r.id
    assert (event.prompt_tokens, event.completion_tokens, event.status) == (
        r.usage.prompt_tokens, r.usage.completion_tokens, "completed")
    assert event.priority == "standard" and event.adapter_version is None and event.api_key_id == t.key_id


def test_chat_streaming_matches_non_streaming_and_reports_usage(platform):
    t = platform.tenant()
    client = platform.openai(t)
    msgs = [{"role": "user", "content": "Name a colour."}]
    # Both answers below start from the prompt this one leaves in the tenant's prefix cache: a
    # hit computes the same tokens in fewer, shorter steps, equal in exact arithmetic but not
    # bit for bit, and a near-tie in a greedy choice may fall either way.
    client.chat.completions.create(model=BASE, messages=msgs, max_tokens=1, temperature=0)
    full = client.chat.completions.create(model=BASE, messages=msgs, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model=BASE, messages=msgs, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # Token by token: more than one content chunk for a multi-token answer.
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1
    events = platform.usage_events(t.name)
    assert len(events) == 3 and {e.status for e in events} == {"completed"}


def test_stream_without_usage_has_no_usage_chunk_and_ends_with_done(platform):
    t = platform.tenant()
    with httpx.stream("POST", f"{platform.url}/v1/chat/completions", headers={"authorization": f"Bearer {t.key}"},
                      json={"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                            "temperature": 0, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert '"usage"' not in "".join(lines)


def test_text_completions_streaming_and_not(platform):
    t = platform.tenant()
    client = platform.openai(t)
    r = client.completions.create(model=BASE, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text
    chunks = list(client.completions.create(model=BASE, prompt="The capital of France is", max_tokens=6,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # Token ids as the prompt.
    ids = platform.gateway.engine.tokenizer.encode("The capital of France is")
    r2 = client.completions.create(model=BASE, prompt=ids, max_tokens=6, temperature=0)
    assert r2.choices[0].text == r.choices[0].text


def test_models_list_and_get(platform):
    t = platform.tenant()
    client = platform.openai(t)
    ids = [m.id for m in client.models.list()]
    assert ids == [BASE]
    assert client.models.retrieve(BASE).id == BASE
    # The base model's card says what it is (extra fields, as vLLM's max_model_len; clients keep them).
    card = client.models.retrieve(BASE).model_dump()
    assert (card["architecture"], card["max_model_len"]) == ("llama", platform.gateway.engine.max_model_len)
    assert client.models.list().data[0].model_dump() == card
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-adapter")
    assert e.value.body["code"] == "model_not_found"


def test_priority_class_request(platform):
    t = platform.tenant(allowed_priorities=["standard", "batch"], default_priority="standard")
    client = platform.openai(t)
    r = client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       temperature=0, extra_body={"priority": "batch"})
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.PermissionDeniedError) as e:
        client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"priority": "realtime"})
    assert e.value.status_code == 403 and e.value.body["code"] == "priority_not_allowed"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"priority": "urgent"})
    assert sorted(e.priority for e in platform.usage_events(t.name)) == ["batch"]


def test_non_text_content_parts_are_a_400_naming_them(platform):
    """An image (or any non-text part) sent to a text-only model is refused by its type, as the
    openai client sends it; text parts are served."""
    t = platform.tenant()
    client = platform.openai(t)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=BASE, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, image]}])
    assert e.value.status_code == 400
    assert e.value.body["message"] == ("messages.0.content: content part 1 has type 'image_url': this model takes "
                                       "text only (parts of type 'text')")
    assert e.value.body["param"] == "messages.0.content"
    r = client.chat.completions.create(model=BASE, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}])
    assert r.usage.completion_tokens >= 1
    assert [ev.status for ev in platform.usage_events(t.name)] == ["completed"]
