"""polar.gym_items: a session as NeMo Gym's response items. Sessions are rebuilt by the real
prefix-merging builder from recorded calls; each row must pass NeMo RL's reading of a Gym row
(every call's prompt begins with everything seen before it, one logprob per generated token)."""

from __future__ import annotations

import json

from polar.gym_items import final_response, gym_response, main_trace, output_items
from polar.trajectory import build, session_trajectory, views_from_protos
from polar.v1 import common_pb2

CHAT = common_pb2.DIALECT_OPENAI_CHAT


def record(
    call_id: str, prompt: list[int], sampled: list[int], body: dict, dialect: int = CHAT
) -> common_pb2.CallRecord:
    return common_pb2.CallRecord(
        call_id=call_id,
        session_id="s",
        dialect=dialect,
        model="policy",
        prompt_token_ids=prompt,
        sampled_token_ids=sampled,
        sampled_logprobs=[-0.5 - i / 10 for i in range(len(sampled))],
        finish_reason=common_pb2.FINISH_REASON_STOP,
        response_body=json.dumps(body).encode(),
    )


def chat(text: str) -> dict:
    return {"choices": [{"message": {"role": "assistant", "content": text}}]}


def session(*records: common_pb2.CallRecord) -> common_pb2.Trajectory:
    return session_trajectory(list(records), build("prefix_merging", views_from_protos(list(records))), "s")


def trainable(response: dict) -> list[dict]:
    """NeMo RL's check of a row (nemo_rl/environments/nemo_gym.py), ported: the calls it trains on."""
    seen: list[int] = []
    calls = []
    for item in response["output"]:
        if not item.get("generation_token_ids"):
            continue
        assert item["prompt_token_ids"][: len(seen)] == seen, "Non-contiguous messages found!"
        assert len(item["generation_log_probs"]) == len(item["generation_token_ids"])
        seen = item["prompt_token_ids"] + item["generation_token_ids"]
        calls.append(item)
    return calls


def test_a_chain_of_calls_is_one_contiguous_row_with_each_call_s_recorded_tokens() -> None:
    first = record("c0001", [1, 2, 3], [4, 5], chat("Let me look."))
    second = record("c0002", [1, 2, 3, 4, 5, 6, 7], [8, 9, 10], chat("Done."))
    answer = gym_response(session(first, second))
    calls = trainable(answer.response)
    assert [c["prompt_token_ids"] for c in calls] == [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7]]
    assert [c["generation_token_ids"] for c in calls] == [[4, 5], [8, 9, 10]]
    assert calls[1]["generation_log_probs"] == list(second.sampled_logprobs)
    assert [item["content"][0]["text"] for item in answer.response["output"]] == ["Let me look.", "Done."]
    assert answer.other_traces == 0 and answer.response["model"] == "policy"


def test_a_compacted_session_answers_the_chain_that_reached_the_end_and_only_it() -> None:
    first = record("c0001", [1, 2, 3, 4, 5, 6], [7, 8], chat("Long."))
    second = record("c0002", [1, 2, 3, 4, 5, 6, 7, 8, 9], [10], chat("Longer."))
    compacted = record("c0003", [1, 20], [21, 22], chat("Short."))
    trajectory = session(first, second, compacted)
    assert [trace.fork_reason for trace in trajectory.traces] == ["", "compaction"]
    answer = gym_response(trajectory)
    assert answer.trace_id == main_trace(trajectory).trace_id == trajectory.traces[1].trace_id
    assert answer.other_traces == 1
    assert [c["prompt_token_ids"] for c in trainable(answer.response)] == [[1, 20]]


def test_the_token_fields_ride_on_the_last_item_of_each_call() -> None:
    body = {
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": "Writing it.",
                    "tool_calls": [{"id": "t1", "function": {"name": "write_file", "arguments": '{"path": "a"}'}}],
                }
            }
        ]
    }
    output = gym_response(session(record("c0001", [1], [2, 3], body))).response["output"]
    assert [item["type"] for item in output] == ["message", "function_call"]
    assert "generation_token_ids" not in output[0] and output[1]["generation_token_ids"] == [2, 3]
    assert (output[1]["call_id"], output[1]["name"], output[1]["arguments"]) == ("t1", "write_file", '{"path": "a"}')


def test_every_dialect_s_reply_becomes_the_same_items() -> None:
    replies = {
        common_pb2.DIALECT_OPENAI_RESPONSES: {
            "output": [
                {"type": "message", "content": [{"type": "output_text", "text": "Hi."}]},
                {"type": "function_call", "call_id": "t1", "name": "ls", "arguments": "{}"},
            ]
        },
        common_pb2.DIALECT_ANTHROPIC_MESSAGES: {
            "content": [{"type": "text", "text": "Hi."}, {"type": "tool_use", "id": "t1", "name": "ls", "input": {}}]
        },
        common_pb2.DIALECT_GOOGLE_GENERATE_CONTENT: {
            "candidates": [
                {"content": {"parts": [{"text": "Hi."}, {"functionCall": {"id": "t1", "name": "ls", "args": {}}}]}}
            ]
        },
    }
    for dialect, body in replies.items():
        items = output_items(record("c0001", [1], [2], body, dialect))
        assert [(item["type"], item.get("name")) for item in items] == [("message", None), ("function_call", "ls")]
        assert items[0]["content"][0]["text"] == "Hi." and items[1]["call_id"] == "t1"
        assert items[1]["arguments"] == "{}"


def test_a_call_whose_body_is_gone_still_gets_an_item() -> None:
    gone = common_pb2.CallRecord(call_id="c0001", dialect=CHAT, bodies_dropped=True)
    assert [item["type"] for item in output_items(gone)] == ["message"]


def test_the_final_response_is_the_last_answered_call_s() -> None:
    failed = record("c0003", [1], [], chat("ignored"))
    failed.error = "upstream went away"
    records = [record("c0001", [1], [2], chat("First.")), record("c0002", [1], [2], chat("Last.")), failed]
    response = final_response(records, "resp_s")
    assert response["id"] == "resp_s"
    assert [item["content"][0]["text"] for item in response["output"]] == ["Last."]
    assert final_response([], "resp_s")["output"] == []
