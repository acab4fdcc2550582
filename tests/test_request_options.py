"""Request options are declared once (RequestOptions) and every surface derives from them."""

from __future__ import annotations

import pytest

from sgl_jax.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from sgl_jax.srt.managers.io_struct import GenerateReqInput
from sgl_jax.srt.managers.request_options import InvalidRequestError, RequestOptions
from sgl_jax.srt.server_args import ServerArgs


def test_every_http_body_declares_every_option():
    for body in (GenerateRequest, CompletionRequest, ChatCompletionRequest):
        assert set(RequestOptions.names()) <= set(body.model_fields), body.__name__


@pytest.mark.parametrize("dtype,num_experts,message", [
    ("uint8", 512, "uint8 holds at most 255 expert ids .* 512 experts: use int16"),
    ("uint8", 255, None), ("uint8", 256, "at most 255"), ("int16", 512, None),
    ("int16", 40000, "use uint16"), ("uint16", 65535, None), ("int32", 70000, None),
    ("int8", 8, "not a routed-experts dtype"), (16, 8, "not a routed-experts dtype"),
])
def test_routed_experts_dtype_must_hold_every_expert(dtype, num_experts, message):
    opts = RequestOptions(return_routed_experts=True, routed_experts_dtype=dtype)
    if message is None:
        assert opts.validate(5, True, num_experts=num_experts).dtype == dtype
        return
    with pytest.raises(InvalidRequestError, match=message) as caught:
        opts.validate(5, True, num_experts=num_experts)
    assert caught.value.param == "routed_experts_dtype"


@pytest.mark.parametrize("options,param,message", [
    ({"return_routed_expert_weights": True}, "return_routed_expert_weights",
     "needs return_routed_experts"),
    ({"return_routed_experts": True, "return_routed_expert_weights": 1},
     "return_routed_expert_weights", "true or false"),
    ({"return_routed_experts": True, "routed_expert_weights_dtype": "float16"},
     "routed_expert_weights_dtype", "needs return_routed_expert_weights"),
    ({"return_routed_experts": True, "return_routed_expert_weights": True,
      "routed_expert_weights_dtype": "bfloat16"}, "routed_expert_weights_dtype",
     "use one of float32, float16"),
])
def test_routing_weight_options(options, param, message):
    with pytest.raises(InvalidRequestError, match=message) as caught:
        RequestOptions(**options).validate(5, True, num_experts=8)
    assert caught.value.param == param
    ok = RequestOptions(return_routed_experts=True, return_routed_expert_weights=True)
    assert ok.validate(5, True).weights_dtype == "float32"


def test_routed_experts_dtype_defaults_to_the_servers():
    opts = RequestOptions(return_routed_experts=True)
    assert opts.validate(5, True, num_experts=8).dtype == "int32"
    assert opts.validate(5, True, num_experts=8, default_dtype="uint8").dtype == "uint8"
    with pytest.raises(InvalidRequestError, match="the server's --routed-experts-dtype=uint8"):
        opts.validate(5, True, num_experts=300, default_dtype="uint8")
    # A request that does not ask is not bothered by a narrow server default.
    assert RequestOptions().validate(5, True, num_experts=300, default_dtype="uint8")
    with pytest.raises(InvalidRequestError, match="needs return_routed_experts"):
        RequestOptions(routed_experts_dtype="uint8").validate(5, True, num_experts=8)
    with pytest.raises(ValueError, match="routed_experts_dtype='int8'"):
        ServerArgs(routed_experts_dtype="int8")


@pytest.mark.parametrize("options,prompt_len,enabled,param,message", [
    ({"return_routed_experts": "yes"}, 5, True, "return_routed_experts", "true or false"),
    ({"return_routed_experts": True}, 5, False, "return_routed_experts",
     "--enable-return-routed-experts"),
    ({"routed_experts_start_len": 0}, 5, True, "routed_experts_start_len",
     "needs return_routed_experts"),
    ({"return_routed_experts": True, "routed_experts_start_len": 6}, 5, True,
     "routed_experts_start_len", r"outside \[0, 5\]"),
    ({"return_routed_experts": True, "routed_experts_start_len": "3"}, 5, True,
     "routed_experts_start_len", "must be an integer"),
    ({"return_routed_experts": True, "routed_experts_start_len": True}, 5, True,
     "routed_experts_start_len", "must be an integer"),
])
def test_validate_names_the_field(options, prompt_len, enabled, param, message):
    with pytest.raises(InvalidRequestError, match=message) as caught:
        RequestOptions(**options).validate(prompt_len, enabled)
    assert caught.value.param == param and isinstance(caught.value, ValueError)


def test_valid_options():
    opts = RequestOptions(return_routed_experts=True, routed_experts_start_len=5).validate(5, True)
    assert opts.start_len == 5 and RequestOptions().start_len == 0


def test_http_body_to_input_keeps_only_the_options_given():
    body = GenerateRequest.model_validate_json(
        '{"text": ["a", "b"], "return_routed_experts": [true, false]}')
    obj = body.to_input()
    assert obj.options == {"return_routed_experts": [True, False]}
    singles = obj.split()
    assert [s.options for s in singles] == [{"return_routed_experts": True},
                                           {"return_routed_experts": False}]
    chat = ChatCompletionRequest.model_validate_json(
        '{"messages": [{"role": "user", "content": "x"}], "routed_experts_start_len": 2}')
    assert chat.options() == {"routed_experts_start_len": 2}


def test_batch_options_rids_and_result_order():
    obj = GenerateReqInput(input_ids=[[1], [2], [3]], options={"routed_experts_start_len": [0, 1]})
    with pytest.raises(InvalidRequestError, match="2 entries for 3 prompts"):
        obj.split()
    obj = GenerateReqInput(input_ids=[[1], [2]], rid=["a", "b"])
    assert obj.ensure_rids() == ["a", "b"] and [s.rid for s in obj.split()] == ["a", "b"]
    fresh = GenerateReqInput(text="x")
    rid = fresh.ensure_rids()
    assert fresh.ensure_rids() == rid and len(rid[0]) == 32  # made up once
    with pytest.raises(InvalidRequestError, match="one per prompt"):
        GenerateReqInput(text=["x", "y"], rid="r").ensure_rids()
    results = [{"index": 1, "t": "b"}, {"index": 0, "t": "a"}]
    assert [r["t"] for r in obj.shape_results(results)] == ["a", "b"]
    assert GenerateReqInput(text="x").shape_results([{"t": "a"}]) == {"t": "a"}
    with pytest.raises(InvalidRequestError, match="the batch is empty"):
        GenerateReqInput(text=[])
    with pytest.raises(InvalidRequestError, match="unknown request option"):
        GenerateReqInput(text="x", options={"return_logprobs": True})


def test_server_info_redacts_the_api_key():
    assert ServerArgs(api_key="secret").redacted()["api_key"] == "<redacted>"
    assert ServerArgs().redacted()["api_key"] is None
