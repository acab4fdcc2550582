"""A multi-turn agentic episode on the OpenAI chat route, token ids in and out, as SGLang-based
RL frameworks drive it: every turn sends the whole context as ``input_ids`` and asks for the
routed-experts rows it has not had yet (``routed_experts_start_len``); the rows of all turns
join into the rows of the whole episode.

Start a server first (the bundled tiny model):

    python -m sgl_jax.launch_server --enable-return-routed-experts --port 30000

then run ``python docs/examples/openai_agentic_turns.py http://127.0.0.1:30000``.
"""

from __future__ import annotations

import sys

import numpy as np
import openai
import pybase64
import requests

from sgl_jax.srt.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def rows_of(meta: dict, layers: int, top_k: int) -> np.ndarray:
    """``meta_info.routed_experts`` (base64 of little-endian int32) -> [rows, layers, top_k]."""
    flat = np.frombuffer(pybase64.b64decode(meta["routed_experts"]), dtype="<i4")
    return flat.reshape(-1, layers, top_k)


def main(url: str) -> dict:
    info = requests.get(f"{url}/get_model_info", timeout=30).json()
    layers, top_k = info["num_hidden_layers"], info["num_experts_per_tok"]
    tokenizer = Tokenizer.from_pretrained(info["model_path"])
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=TOOLS)
    context = tokenizer.encode(text, add_special_tokens=False)
    start, turns = 0, []
    for turn in range(3):
        out = client.chat.completions.create(
            model="default", messages=messages, max_tokens=8, temperature=0, logprobs=True,
            tools=TOOLS, tool_choice="auto",
            extra_body={
                "input_ids": context,             # the prompt exactly: no chat template
                "return_meta_info": True,         # meta_info with output_token_logprobs
                "return_routed_experts": True,
                "routed_experts_start_len": start,  # only the rows not returned before
                "return_output_ids_in_sglext": True,
            })
        choice = out.choices[0]
        meta = choice.meta_info
        output_ids = out.sglext["output_ids"]
        logprobs = [entry[0] for entry in meta["output_token_logprobs"]]
        turns.append({"rows": rows_of(meta, layers, top_k), "output_ids": output_ids,
                      "logprobs": logprobs, "tool_calls": choice.message.tool_calls})
        print(f"turn {turn}: {len(context)} prompt tokens, {len(output_ids)} generated, "
              f"{turns[-1]['rows'].shape[0]} new rows, tool calls: {choice.message.tool_calls}")
        context = context + output_ids
        start = len(context) - 1  # the next turn's rows begin where these ended
        # The tool's answer (or the user's next message) in the model's own format.
        tail = "<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>" \
               "<|im_end|>\n<|im_start|>assistant\n"
        context = context + tokenizer.encode(tail, add_special_tokens=False)
    episode = context[: start + 1]  # every token the turns saw, the last tool answer aside
    rows = np.concatenate([t["rows"] for t in turns])
    assert rows.shape == (len(episode) - 1, layers, top_k)
    print(f"episode: {len(episode)} tokens, rows {rows.shape}")
    return {"episode": episode, "rows": rows, "turns": turns}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:30000")
