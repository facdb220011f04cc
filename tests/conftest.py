"""Shared fixtures: the local default stack, brought up once per session (idempotent)."""

from __future__ import annotations

import uuid

import pytest

from streamtune.stack import Stack, StackConfig


@pytest.fixture(scope="session")
def stack_config() -> StackConfig:
    config = StackConfig.from_env()
    statuses = Stack(config).up(echo=lambda line: None)
    unhealthy = [s.name for s in statuses if not s.healthy]
    assert not unhealthy, f"stack components not healthy: {unhealthy}"
    return config


@pytest.fixture
def unique() -> str:
    """A short random name part, so tests never share topics, tables or models."""
    return uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def base_model(stack_config):
    """The tiny Llama + locally trained tokenizer, as an HF directory (built once, cached)."""
    from streamtune.tinymodel import build_tiny_llama

    return build_tiny_llama(stack_config.data_dir / "models" / "tiny-llama")

