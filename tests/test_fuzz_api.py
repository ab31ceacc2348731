"""Fuzz the HTTP API from its own OpenAPI schema: no 5xx, every error in OpenAI's shape."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import start_cluster

pytestmark = pytest.mark.slow

JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                      st.floats(allow_nan=False, allow_infinity=False),
                      st.text(max_size=40))
ANY_JSON = st.recursive(JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=12)


def from_schema(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that fit the schema (roughly, edges included): enough to get past shallow
    checks. ``defs``: the OpenAPI components a ``$ref`` names."""
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs))
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of(*(from_schema(s, defs) for s in schema["anyOf"]))
    t = schema.get("type")
    if t == "string":
        return st.text(max_size=64)
    if t == "integer":
        return st.integers(schema.get("minimum", -5), schema.get("maximum", 5000))
    if t == "number":
        return st.floats(schema.get("minimum", -1.0), schema.get("maximum", 3.0), allow_nan=False,
                         allow_infinity=False)
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    if t == "array":
        return st.lists(from_schema(schema.get("items", {}), defs), max_size=schema.get("maxItems", 4))
    if t == "object":
        props, required = schema.get("properties", {}), schema.get("required", [])
        return st.fixed_dictionaries({k: from_schema(props[k], defs) for k in required},
                                     optional={k: from_schema(v, defs) for k, v in props.items() if k not in required})
    return ANY_JSON


def body_strategy(schema: dict[str, Any], defs: dict[str, Any], model: str) -> st.SearchStrategy[Any]:
    props = schema["properties"]
    fields = {k: st.one_of(from_schema(v, defs), ANY_JSON) if k != "model" else st.sampled_from([model, "other"])
              for k, v in props.items()}
    well_formed = st.fixed_dictionaries({k: fields[k] for k in schema.get("required", [])},
                                        optional={k: v for k, v in fields.items() if k not in schema.get("required", [])})
    limit = {"max_output_tokens": 4} if "max_output_tokens" in props else {"max_tokens": 4}   # /v1/responses' name
    return st.one_of(well_formed, well_formed.map(lambda d: {**d, **limit}), ANY_JSON)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    cluster = start_cluster(tmp_path_factory.mktemp("fuzz"), "--ranks", "2", "--api-servers", "1",
                            "--backend", "sim", "--time-scale", "0", namespace="fuzz")
    spec = httpx.get(cluster.api_url.rsplit("/v1", 1)[0] + "/openapi.json", timeout=10).json()
    yield cluster, spec
    cluster.stop()


def check(resp: httpx.Response) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
                                  "/detokenize"])
def test_fuzz_from_openapi_schema(api, path):
    cluster, spec = api
    defs = spec["components"]["schemas"]
    ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = defs[ref.rsplit("/", 1)[1]]
    url = cluster.api_url.rsplit("/v1", 1)[0] + path
    client = httpx.Client(timeout=60)

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(body=body_strategy(schema, defs, "lockstep-moe"))
    def run(body: Any) -> None:
        check(client.post(url, json=body))

    run()
    client.close()


def test_fuzz_raw_bytes(api):
    cluster, _ = api
    client = httpx.Client(timeout=30)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(raw=st.binary(max_size=200), path=st.sampled_from(["/v1/completions", "/v1/chat/completions",
                                                              "/v1/responses"]))
    def run(raw: bytes, path: str) -> None:
        check(client.post(cluster.api_url.rsplit("/v1", 1)[0] + path, content=raw,
                          headers={"content-type": "application/json"}))

    run()
    client.close()
