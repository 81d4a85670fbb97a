"""LoRA adapters through the gateway with the official `openai` client (vLLM's routes): loaded at
run time, listed by /v1/models, chosen by `model`, unloaded; unknown names answer 404 in OpenAI's
error shape."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers.lora_adapters import make_peft_adapter
from tests.helpers.tiny_models import smollm2_path

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> str:
    # Big enough to change SmolLM2's greedy text, random: it need not say anything sensible.
    base = smollm2_path()
    return make_peft_adapter(tmp_path_factory.mktemp("lora") / "demo", base, r=8, lora_alpha=32, std=0.05)


def _complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    return out.choices[0].text


def test_load_select_list_and_unload(
    openai_client: openai.OpenAI, gateway_http: httpx.Client, adapter: str
) -> None:
    base_model = openai_client.models.list().data[0].id
    base_text = _complete(openai_client, base_model)
    r = gateway_http.post("/v1/load_lora_adapter", json={"lora_name": "demo", "lora_path": adapter})
    assert r.status_code == 200, r.text
    try:
        again = gateway_http.post("/v1/load_lora_adapter", json={"lora_name": "demo", "lora_path": adapter})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        cards = {m.id: m for m in openai_client.models.list().data}
        assert cards["demo"].root == adapter and cards["demo"].parent == base_model  # type: ignore[attr-defined]
        lora_text = _complete(openai_client, "demo")
        assert lora_text != base_text
        # The same adapter again (now from its own cached prefix) and the base: unchanged.
        assert _complete(openai_client, "demo") == lora_text
        assert _complete(openai_client, base_model) == base_text
        chat = openai_client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
        assert chat.model == "demo" and chat.choices[0].message.content is not None
    finally:
        r = gateway_http.post("/v1/unload_lora_adapter", json={"lora_name": "demo"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError) as e:
        _complete(openai_client, "demo")
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"  # type: ignore[index]
    gone = gateway_http.post("/v1/unload_lora_adapter", json={"lora_name": "demo"})
    assert gone.status_code == 404 and gone.json()["error"]["message"]


def test_a_folder_that_is_no_adapter_is_refused(gateway_http: httpx.Client, tmp_path) -> None:
    r = gateway_http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "lora_path"
    r = gateway_http.post("/v1/load_lora_adapter", json={"lora_name": "bad name", "lora_path": str(tmp_path)})
    assert r.status_code == 400
