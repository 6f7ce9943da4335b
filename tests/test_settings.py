"""Settings from the environment: defaults, accepted values, clear errors."""

import os
import re

import pytest

from tf_rdma import settings
from tf_rdma.errors import ConfigError

pytestmark = pytest.mark.fast  # in `make test-fast`: no processes, no sockets

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults():
    assert settings.transport(env={}) == "auto"
    assert settings.timeout_seconds(env={}) == 60.0
    assert settings.poll_microseconds(env={}) == 50
    assert settings.collective_spin_microseconds(env={}) == "auto"


def test_values_from_environment_and_arguments():
    env = {"TF_RDMA_TRANSPORT": " TCP ", "TF_RDMA_TIMEOUT": "2.5",
           "TF_RDMA_POLL_US": "0", "TF_RDMA_SECRET": "abc-0123456789-abc"}
    assert settings.transport(env=env) == "tcp"
    assert settings.timeout_seconds(env=env) == 2.5
    assert settings.poll_microseconds(env=env) == 0
    assert settings.collective_spin_microseconds(
        env={"TF_RDMA_COLLECTIVE_SPIN_US": " Auto "}) == "auto"
    assert settings.collective_spin_microseconds(
        env={"TF_RDMA_COLLECTIVE_SPIN_US": "0"}) == 0
    assert settings.collective_spin_microseconds(
        env={"TF_RDMA_COLLECTIVE_SPIN_US": "100000"}) == 100000
    assert settings.secret(env=env) == "abc-0123456789-abc"
    assert settings.host_cpus(env={}) == 0
    assert settings.host_cpus(env={"TF_RDMA_HOST_CPUS": "8"}) == 8
    # An explicit argument wins over the environment.
    assert settings.timeout_seconds(7, env=env) == 7.0
    assert settings.secret("xyz-0123456789-xyz", env=env) == "xyz-0123456789-xyz"


@pytest.mark.parametrize("function, variable, value", [
    (settings.transport, "TF_RDMA_TRANSPORT", "rdma"),
    (settings.timeout_seconds, "TF_RDMA_TIMEOUT", "-1"),
    (settings.timeout_seconds, "TF_RDMA_TIMEOUT", "nan"),
    (settings.timeout_seconds, "TF_RDMA_TIMEOUT", "soon"),
    (settings.timeout_seconds, "TF_RDMA_TIMEOUT", "1e9"),
    (settings.poll_microseconds, "TF_RDMA_POLL_US", "lots"),
    (settings.poll_microseconds, "TF_RDMA_POLL_US", "10001"),
    (settings.poll_microseconds, "TF_RDMA_POLL_US", "-1"),
    (settings.collective_spin_microseconds, "TF_RDMA_COLLECTIVE_SPIN_US",
     "spin"),
    (settings.collective_spin_microseconds, "TF_RDMA_COLLECTIVE_SPIN_US",
     "100001"),
    (settings.collective_spin_microseconds, "TF_RDMA_COLLECTIVE_SPIN_US",
     "-5"),
    (settings.host_cpus, "TF_RDMA_HOST_CPUS", "0"),
    (settings.host_cpus, "TF_RDMA_HOST_CPUS", "many"),
    (settings.host_cpus, "TF_RDMA_HOST_CPUS", "65537"),
])
def test_bad_values_name_variable_and_value(function, variable, value):
    with pytest.raises(ConfigError) as info:
        function(env={variable: value})
    assert variable in str(info.value) and repr(value) in str(info.value)


@pytest.mark.parametrize("secret", ["", "has space", "x", "fifteen-chars15"])
def test_bad_secrets(secret):
    with pytest.raises(ConfigError, match="TF_RDMA_SECRET"):
        settings.secret(env={"TF_RDMA_SECRET": secret})


README = __import__("pathlib").Path(__file__).resolve().parent.parent / "README.md"
_BEGIN = "<!-- generated from tf_rdma/settings.py (SETTINGS); tests/test_settings.py checks it -->\n"
_END = "<!-- end of generated settings table -->\n"


def test_readme_settings_table_is_generated_from_the_code():
    """The README's table is settings.markdown_table(); with
    TF_RDMA_REGENERATE_DOCS=1 the test rewrites it instead of failing."""
    import os

    text = README.read_text()
    start = text.index(_BEGIN) + len(_BEGIN)
    end = text.index(_END, start)
    wanted = settings.markdown_table()
    if os.environ.get("TF_RDMA_REGENERATE_DOCS") == "1":
        README.write_text(text[:start] + wanted + text[end:])
        text = README.read_text()
        end = text.index(_END, start)
    assert text[start:end] == wanted, (
        "README.md's settings table differs from tf_rdma/settings.py; run "
        "TF_RDMA_REGENERATE_DOCS=1 pytest tests/test_settings.py")


def test_settings_table_lists_every_variable_the_code_reads():
    import pathlib
    import re

    from tf_rdma import cluster

    assert settings.DEFAULT_PORT_OFFSET == cluster.DEFAULT_PORT_OFFSET
    root = pathlib.Path(settings.__file__).resolve().parent
    read = set()
    for path in list(root.rglob("*.py")) + list((root.parent / "kernels").rglob("*.cc")):
        read |= set(re.findall(r"\bTF_RDMA_[A-Z_]+\b", path.read_text()))
    # Names that are not settings: the test switch, the doc regenerator,
    # C++ macro/identifier prefixes, and "TF_RDMA_VERBS_*" in prose.
    read -= {"TF_RDMA_TEST_VERBS", "TF_RDMA_REGENERATE_DOCS",
             "TF_RDMA_BUILT_TF_VERSION", "TF_RDMA_RETURN_IF_ERROR",
             "TF_RDMA_TYPES", "TF_RDMA_COLLECTIVE_TYPES", "TF_RDMA_SLOT_ATTRS", "TF_RDMA_CASE",
             "TF_RDMA_VECTORIZE",
             "TF_RDMA_VERBS_ENTRY", "TF_RDMA_VERBS_"}
    read = {name for name in read if not name.endswith("_H_")}
    assert read == {s.name for s in settings.SETTINGS}


def test_min_secret_length_matches_the_engine():
    header = open(os.path.join(REPO_ROOT, "kernels", "engine", "engine.h")).read()
    m = re.search(r"kMinSecretBytes = (\d+);", header)
    assert m and int(m.group(1)) == settings.MIN_SECRET_LENGTH
    assert settings.secret("a" * settings.MIN_SECRET_LENGTH, env={}) == "a" * 16


def test_spin_limit_matches_the_engine():
    header = open(os.path.join(REPO_ROOT, "kernels", "engine", "engine.h")).read()
    m = re.search(r"kMaxSpinUs = (\d+);", header)
    assert m and int(m.group(1)) == settings.MAX_SPIN_US
