"""ChoiceStream (the shared ChoiceState over the scheduler's responses): incremental
detokenization and stop strings on the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from gateway.generation import ChoiceStream
from llmesh.v1 import generation_pb2 as g
from services.choices import child_seed

TRICKY = "Ça coûte 5€ — 日本語のテキスト 😀👍🏽 naïve café"


def responses(ids: list[int], per: int = 1, finish=g.FINISH_REASON_LENGTH) -> list[g.GenerateResponse]:
    out = []
    for i in range(0, len(ids), per):
        resp = g.GenerateResponse(token_ids=ids[i : i + per])
        if i + per >= len(ids):
            resp.finish_reason = finish
        out.append(resp)
    return out


def run(state: ChoiceStream, resps: list[g.GenerateResponse]):
    deltas, cancels = [], []
    for r in resps:
        d, cancel = state.absorb(r)
        deltas.append(d)
        cancels.append(cancel)
        if state.finished:
            break
    return deltas, cancels


@pytest.mark.parametrize("per", [1, 2, 3])
def test_multibyte_text_streams_whole(tokenizer, per):
    ids = tokenizer.encode(TRICKY, add_special_tokens=False)
    # Several tokens are pieces of one character: decoding them one by one would give U+FFFD.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    state = ChoiceStream(0, tokenizer, [], skip_special=True, include_stop=False)
    deltas, _ = run(state, responses(ids, per))
    assert not any("\ufffd" in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == TRICKY
    assert deltas[-1].finish_reason == "length"
    assert state.num_tokens == len(ids)


def test_stop_string_is_cut_held_back_and_cancels(tokenizer):
    text = " The answer is forty-two, my friend. And more text follows here."
    ids = tokenizer.encode(text, add_special_tokens=False)
    state = ChoiceStream(0, tokenizer, ["my friend"], skip_special=True, include_stop=False)
    deltas, cancels = run(state, responses(ids))
    out = "".join(d.text for d in deltas)
    assert out == " The answer is forty-two, "
    # No delta ever showed a piece of the stop string that was later taken back.
    assert "my" not in out
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "my friend"
    assert cancels[-1] is True  # ended here, upstream still running: cancel it
    # Tokens are counted up to (and including) the one that completed the stop string.
    assert state.num_tokens < len(ids)
    assert tokenizer.decode(ids[: state.num_tokens]).endswith("friend")


def test_stop_string_kept_when_asked(tokenizer):
    ids = tokenizer.encode(" one two three four", add_special_tokens=False)
    state = ChoiceStream(0, tokenizer, ["three"], skip_special=True, include_stop=True)
    deltas, _ = run(state, responses(ids))
    assert "".join(d.text for d in deltas) == " one two three"


def test_stop_inside_one_response_drops_the_rest(tokenizer):
    ids = tokenizer.encode(" alpha beta gamma delta", add_special_tokens=False)
    state = ChoiceStream(0, tokenizer, ["beta"], skip_special=True, include_stop=False)
    delta, cancel = state.absorb(responses(ids, per=len(ids))[0])  # all tokens, and upstream finished
    assert delta.text == " alpha " and delta.finish_reason == "stop"
    assert cancel is True  # tokens after the stop arrived in the same response


def test_held_back_prefix_is_released_when_it_does_not_stop(tokenizer):
    ids = tokenizer.encode(" a b c d", add_special_tokens=False)
    state = ChoiceStream(0, tokenizer, [" c x"], skip_special=True, include_stop=False)
    deltas, _ = run(state, responses(ids))
    assert "".join(d.text for d in deltas) == " a b c d"
    assert deltas[-1].finish_reason == "length"


def test_eos_stop_token_and_logprobs(tokenizer):
    ids = tokenizer.encode(" Hi", add_special_tokens=False) + [2]  # 2 = <|im_end|>, a special token
    resp = g.GenerateResponse(token_ids=ids, finish_reason=g.FINISH_REASON_STOP, stop_token_id=2)
    resp.logprobs.CopyFrom(
        g.Logprobs(
            token_index=[0, 1], logprob=[-0.1, -0.2], rank=[1, 2], num_top=[2, 1],
            top_token_ids=[ids[0], 5, 9], top_logprobs=[-0.1, -2.0, -0.05],
        )
    )  # fmt: skip
    state = ChoiceStream(3, tokenizer, [], skip_special=True, include_stop=False)
    delta, cancel = state.absorb(resp)
    assert delta.index == 3 and delta.text == " Hi" and not cancel
    assert delta.finish_reason == "stop" and delta.stop_reason == 2
    assert [(e.token_id, e.logprob) for e in delta.logprobs] == [
        (ids[0], pytest.approx(-0.1)),
        (2, pytest.approx(-0.2)),
    ]
    assert delta.logprobs[0].top[1][0] == 5


def test_token_bytes_and_text(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == "😀".encode()
    assert tokenizer.token_text(2) == "<|im_end|>"
    assert tokenizer.token_text(tokenizer.encode(" Paris", add_special_tokens=False)[0]) == " Paris"


def test_child_seeds_wrap_in_int64():
    assert child_seed(None, 3) is None
    assert child_seed(10, 2) == 12
    assert child_seed(2**63 - 1, 1) == -(2**63)
