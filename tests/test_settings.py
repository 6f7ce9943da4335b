"""Settings from the environment: defaults, accepted values, clear errors."""

import pytest

from tf_rdma import settings
from tf_rdma.errors import ConfigError


def test_defaults():
    assert settings.transport(env={}) == "auto"
    assert settings.timeout_seconds(env={}) == 60.0
    assert settings.poll_microseconds(env={}) == 50


def test_values_from_environment_and_arguments():
    env = {"TF_RDMA_TRANSPORT": " TCP ", "TF_RDMA_TIMEOUT": "2.5",
           "TF_RDMA_POLL_US": "0", "TF_RDMA_SECRET": "abc"}
    assert settings.transport(env=env) == "tcp"
    assert settings.timeout_seconds(env=env) == 2.5
    assert settings.poll_microseconds(env=env) == 0
    assert settings.secret(env=env) == "abc"
    # An explicit argument wins over the environment.
    assert settings.timeout_seconds(7, env=env) == 7.0
    assert settings.secret("xyz", env=env) == "xyz"


@pytest.mark.parametrize("function, variable, value", [
    (settings.transport, "TF_RDMA_TRANSPORT", "rdma"),
    (settings.timeout_seconds, "TF_RDMA_TIMEOUT", "-1"),
    (settings.timeout_seconds, "TF_RDMA_TIMEOUT", "nan"),
    (settings.timeout_seconds, "TF_RDMA_TIMEOUT", "soon"),
    (settings.timeout_seconds, "TF_RDMA_TIMEOUT", "1e9"),
    (settings.poll_microseconds, "TF_RDMA_POLL_US", "lots"),
    (settings.poll_microseconds, "TF_RDMA_POLL_US", "10001"),
    (settings.poll_microseconds, "TF_RDMA_POLL_US", "-1"),
])
def test_bad_values_name_variable_and_value(function, variable, value):
    with pytest.raises(ConfigError) as info:
        function(env={variable: value})
    assert variable in str(info.value) and repr(value) in str(info.value)


@pytest.mark.parametrize("secret", ["", "has space"])
def test_bad_secrets(secret):
    with pytest.raises(ConfigError, match="TF_RDMA_SECRET"):
        settings.secret(env={"TF_RDMA_SECRET": secret})
