"""SGLang's request fields we do not implement: one table (sglang_fields), every body uses it.

The ROUTER_* bodies are what sglang-router 0.3.2 sent to a capturing worker for minimal
requests (docs/scaling.md): they must validate as they are.
"""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, ValidationError

from sgl_jax.srt import sglang_fields
from sgl_jax.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    StreamOptions,
    describe_validation_error,
)
from sgl_jax.srt.managers.request_options import InvalidRequestError, RequestOptions
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.server_args import ServerArgs

ROUTER_GENERATE = {
    "text": "Hello", "model": None, "sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
    "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
    "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
    "return_entropy": False, "rid": "r1"}
ROUTER_CHAT = {
    "messages": [{"role": "user", "content": "hi"}], "model": "m", "logprobs": False,
    "max_completion_tokens": 4, "stream": True, "temperature": 0.0, "top_k": 1,
    "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
    "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
    "return_hidden_states": False}
# Every field name sglang-router 0.3.2 forwarded when given one (the captured bodies).
ROUTER_FIELDS = {
    sglang_fields.GENERATE: (
        "text model input_ids input_embeds image_data video_data audio_data sampling_params rid "
        "return_logprob logprob_start_len top_logprobs_num token_ids_logprob "
        "return_text_in_logprobs stream log_metrics return_hidden_states modalities "
        "session_params lora_path lora_id custom_logit_processor bootstrap_host bootstrap_port "
        "bootstrap_room bootstrap_pair_key data_parallel_rank background conversation_id "
        "priority extra_key no_logs custom_labels return_bytes return_entropy"),
    sglang_fields.CHAT: (
        "messages model frequency_penalty function_call functions logit_bias logprobs "
        "max_tokens max_completion_tokens metadata modalities n parallel_tool_calls "
        "presence_penalty reasoning_effort response_format safety_identifier seed service_tier "
        "stop stream stream_options temperature tool_choice tools top_logprobs top_p verbosity "
        "top_k min_p min_tokens repetition_penalty regex ebnf stop_token_ids no_stop_trim "
        "ignore_eos continue_final_message skip_special_tokens lora_path session_params "
        "separate_reasoning stream_reasoning chat_template_kwargs return_hidden_states "
        "sampling_seed"),
    sglang_fields.COMPLETION: (
        "model prompt suffix max_tokens temperature top_p n stream stream_options logprobs echo "
        "stop presence_penalty frequency_penalty best_of logit_bias user seed top_k min_p "
        "min_tokens repetition_penalty regex ebnf json_schema stop_token_ids no_stop_trim "
        "ignore_eos skip_special_tokens lora_path session_params return_hidden_states "
        "sampling_seed"),
    sglang_fields.SAMPLING: (
        "temperature max_new_tokens top_p top_k frequency_penalty presence_penalty "
        "repetition_penalty stop ignore_eos skip_special_tokens json_schema regex ebnf min_p "
        "min_new_tokens stop_token_ids no_stop_trim n sampling_seed"),
}
ROUTER_COMPLETION = {
    "model": "m", "prompt": ["a", "b"], "stream": False, "echo": False, "no_stop_trim": False,
    "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False}

BODIES = {sglang_fields.GENERATE: (GenerateRequest, {"text": "x"}),
          sglang_fields.CHAT: (ChatCompletionRequest,
                               {"messages": [{"role": "user", "content": "x"}]}),
          sglang_fields.COMPLETION: (CompletionRequest, {"prompt": "x"}),
          sglang_fields.STREAM_OPTIONS: (StreamOptions, {})}
# Something no field of the table takes as neutral, and of no label type either.
ODD_VALUE = 12.5


def validate(model: type[BaseModel], body: dict) -> BaseModel:
    return model.model_validate_json(json.dumps(body))


def refused(model: type[BaseModel], body: dict) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as caught:
        validate(model, body)
    return describe_validation_error(caught.value)


def cases() -> list[tuple[str, str]]:
    return [(s, f.name) for f in sglang_fields.FIELDS for s in sorted(f.surfaces)]


def test_the_routers_bodies_validate_as_sent():
    body = validate(GenerateRequest, ROUTER_GENERATE)
    assert body.to_input().options == {"return_text_in_logprobs": False}
    chat = validate(ChatCompletionRequest, ROUTER_CHAT)
    assert chat.max_completion_tokens == 4 and chat.top_k == 1
    assert validate(CompletionRequest, ROUTER_COMPLETION).prompt == ["a", "b"]


@pytest.mark.parametrize("surface", sorted(ROUTER_FIELDS))
def test_every_field_the_router_forwards_is_ours_or_in_the_table(surface):
    ours = (set(SamplingParams().to_dict()) | {"sampling_seed"}
            if surface == sglang_fields.SAMPLING else set(BODIES[surface][0].model_fields))
    missing = set(ROUTER_FIELDS[surface].split()) - ours - set(sglang_fields.fields_of(surface))
    assert not missing, missing


@pytest.mark.parametrize("surface,name", cases())
def test_every_field_takes_null_and_its_neutral_values_and_refuses_others(surface, name):
    field = sglang_fields.fields_of(surface)[name]
    if surface == sglang_fields.SAMPLING:
        for value in (None, *field.neutral):
            assert SamplingParams.from_dict({name: value}) == SamplingParams()
        with pytest.raises(ValueError, match=rf"^sampling_params\.{name}: "):
            SamplingParams.from_dict({name: ODD_VALUE})
        return
    model, base = BODIES[surface]
    for value in (None, *field.neutral):
        validate(model, {**base, name: value})
    message, param = refused(model, {**base, name: ODD_VALUE})
    assert param == name and message.startswith(f"{name}: ")
    assert ("not supported by this server" in message) == (field.label_type is None)


@pytest.mark.parametrize("surface,name", [c for c in cases() if
                                          sglang_fields.fields_of(c[0])[c[1]].label_type])
def test_a_label_field_takes_any_value_of_its_type(surface, name):
    field = sglang_fields.fields_of(surface)[name]
    value = {bool: True, str: "tag", dict: {"a": "b"}}[field.label_type]
    model, base = BODIES.get(surface, (None, None))
    validate(model, {**base, name: value})
    if field.label_type is bool:  # JSON 1 is not true
        assert refused(model, {**base, name: 1})[1] == name


def test_no_table_field_shadows_one_we_implement():
    ours = {
        sglang_fields.GENERATE: set(GenerateRequest.model_fields),
        sglang_fields.CHAT: set(ChatCompletionRequest.model_fields),
        sglang_fields.COMPLETION: set(CompletionRequest.model_fields),
        sglang_fields.STREAM_OPTIONS: set(StreamOptions.model_fields),
    }
    for surface, fields in ours.items():
        table = set(sglang_fields.fields_of(surface))
        assert table <= fields  # declared by the body...
        assert not table & set(RequestOptions.names())  # ...and never one of our options
    sampling = set(sglang_fields.fields_of(sglang_fields.SAMPLING))
    assert not sampling & set(SamplingParams().to_dict())
    for name in ("seed", "top_k", "max_tokens", "return_routed_experts", "text", "n"):
        assert all(name not in sglang_fields.fields_of(s) for s in sglang_fields.SURFACES)


def test_values_are_compared_with_their_json_type():
    # 0 is not false, false is not 0, 1.0 is not 0.
    base = {"text": "x"}
    assert refused(GenerateRequest, {**base, "return_hidden_states": 0})[1] == \
        "return_hidden_states"
    assert refused(GenerateRequest, {**base, "data_parallel_rank": False})[1] == \
        "data_parallel_rank"
    validate(GenerateRequest, {**base, "data_parallel_rank": 0})
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams.from_dict({"min_new_tokens": False})


@pytest.mark.parametrize("model,body,param", [
    (GenerateRequest, {"text": "x", "return_hidden_states": True}, "return_hidden_states"),
    (GenerateRequest, {"text": "x", "lora_path": "adapter"}, "lora_path"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "functions": [
        {"name": "f"}]}, "functions"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                             "stream": True, "stream_options": {
                                 "include_usage": True, "continuous_usage_stats": True}},
     "stream_options"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                             "reasoning_effort": "high"}, "reasoning_effort"),
    (CompletionRequest, {"prompt": "x", "min_tokens": 3}, "min_tokens"),
])
def test_asking_for_what_we_do_not_do_names_the_field(model, body, param):
    message, got = refused(model, body)
    assert got == param and "not supported by this server" in message


def test_unknown_fields_keep_their_old_fate():
    assert refused(GenerateRequest, {"text": "x", "made_up": 1}) == (
        "made_up: Extra inputs are not permitted (got 1)", "made_up")
    validate(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                     "made_up": 1})
    assert refused(StreamOptions, {"made_up": True})[1] == "made_up"  # closed object
    with pytest.raises(ValueError, match="unknown sampling parameter 'made_up'"):
        SamplingParams.from_dict({"made_up": 1})


def test_sampling_seed_is_sglangs_spelling_of_seed():
    assert SamplingParams.from_dict({"sampling_seed": 7}).seed == 7
    assert SamplingParams.from_dict({"sampling_seed": 7, "seed": 7}).seed == 7
    with pytest.raises(ValueError, match="disagree"):
        SamplingParams.from_dict({"sampling_seed": 7, "seed": 8})
    chat = validate(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                            "sampling_seed": 5})
    assert chat.request_seed == 5
    both = validate(CompletionRequest, {"prompt": "x", "seed": 1, "sampling_seed": 2})
    with pytest.raises(InvalidRequestError, match="disagree") as caught:
        both.request_seed  # noqa: B018 - the property raises
    assert caught.value.param == "sampling_seed"


def test_return_routed_experts_default_needs_the_feature():
    assert ServerArgs(enable_return_routed_experts=True, return_routed_experts_default=True)
    with pytest.raises(ValueError, match="needs enable_return_routed_experts"):
        ServerArgs(return_routed_experts_default=True)
