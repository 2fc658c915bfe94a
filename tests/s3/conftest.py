"""Fixtures of the object-store tests: one local S3-API server per session, emptied for every test.

``s3`` sets ``AWS_ENDPOINT_URL`` and dummy credentials in the environment (monkeypatched, so that
subprocesses the test starts, the launcher's ranks and ``ckpt``, reach the same server) and yields
a boto3 client with a fresh bucket :data:`BUCKET`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import s3_server

BUCKET = "ckpt-test"


@dataclass
class S3:
    endpoint: str
    client: Any  # a boto3 S3 client: the tests' independent view of what is in the bucket
    bucket: str = BUCKET

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for p in pages for o in p.get("Contents", []))


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    with s3_server.moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> S3:
    s3_server.reset(s3_endpoint)
    return S3(s3_endpoint, s3_server.point_at(monkeypatch, s3_endpoint, BUCKET))


@pytest.fixture
def puts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The relative names the writer's upload puts, in order."""
    from gtp_format.storage import upload as up

    order: list[str] = []
    real = up.Upload._put

    def spy(self: Any, local: Any, rel: str, create: bool = False) -> None:
        real(self, local, rel, create)
        order.append(rel)

    monkeypatch.setattr(up.Upload, "_put", spy)
    return order


@pytest.fixture(scope="module")
def hf_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face folder (the local export of the DCP fixture): ``import --from hf``'s SRC."""
    from test_read import FIXTURES

    from ckpt_tool.cli import run

    out = tmp_path_factory.mktemp("hf") / "model"
    assert run(["export", str(FIXTURES["dcp"]), str(out), "--to", "hf", "--format", "json"]) == 0
    return out
