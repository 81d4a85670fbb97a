"""RequestDelta coalescing: what a slow reader gets in one message."""

from scheduler_svc.request import FinishReason, RequestDelta, coalesce


def d(rid: str, tokens: list[int], finish=None, n_out: int = 0) -> RequestDelta:
    return RequestDelta(rid, tokens, [None] * len(tokens), finish, 3, n_out, 0)


def test_pending_deltas_of_one_request_become_one_in_order():
    out = coalesce(
        [
            d("a", [1], n_out=1),
            d("b", [9], n_out=1),
            d("a", [2, 3], n_out=3),
            d("a", [4], FinishReason.STOP, 4),
        ]
    )
    assert [(x.request_id, x.new_token_ids, x.finish_reason, x.num_output_tokens) for x in out] == [
        ("a", [1, 2, 3, 4], FinishReason.STOP, 4),
        ("b", [9], None, 1),
    ]
    assert len(out[0].new_logprobs) == 4


def test_an_error_ends_the_list_and_inputs_are_not_changed():
    first = d("a", [1], n_out=1)
    err = RuntimeError("gone")
    out = coalesce([first, d("a", [2], n_out=2), err, d("a", [3], n_out=3)])
    assert out[0].new_token_ids == [1, 2] and out[1] is err and len(out) == 2
    assert first.new_token_ids == [1]
