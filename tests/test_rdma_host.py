"""tests/rdma_host.sh, the Soft-RoCE runner of the verbs tests, where it
cannot run: it says what is missing and exits 2, never a traceback, and
leaves nothing behind.

The script itself runs the verbs tests and the conformance suite on an
rdma_rxe device with TF_RDMA_TEST_VERBS=1 (docs/verbs.md, "Running on a
Soft-RoCE host"); that needs a kernel with rdma_rxe and root, which this
repository's CI does not have. These tests check its help, its syntax
(bash -n, and shellcheck where installed), its refusals, and, with stand-ins
for modprobe and rdma, that a setup failing midway removes the namespaces,
the veth pair and the device it made. All but the first two are skipped on
a host where rdma_rxe exists, since there the script would go on to set up
Soft-RoCE for real.
"""

import os
import shutil
import stat
import subprocess

import pytest

from conftest import REPO, ip

SCRIPT = os.path.join(REPO, "tests", "rdma_host.sh")

pytestmark = pytest.mark.timeout(60)


def rxe_present():
    """True when rdma_rxe is loaded or modprobe can load it here."""
    if os.path.isdir("/sys/module/rdma_rxe"):
        return True
    modprobe = shutil.which("modprobe") or shutil.which("/sbin/modprobe")
    if modprobe is None:
        return False
    return subprocess.run([modprobe, "-n", "-q", "rdma_rxe"],
                          capture_output=True, timeout=30).returncode == 0


def run(*args, env=None):
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True,
                          text=True, timeout=60, env=env,
                          stdin=subprocess.DEVNULL)


def namespaces():
    if not os.path.exists("/run/netns"):
        return set()
    return {n for n in os.listdir("/run/netns") if n.startswith("tfrdma-rxe-")}


def stub_modprobe(tmp_path, dry_run_status, load_message):
    """A modprobe first on PATH: its dry run (-n) exits dry_run_status, a
    load prints load_message and fails."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "modprobe"
    stub.write_text(
        "#!/bin/sh\n"
        "case \" $* \" in *' -n '*) "
        f"[ {dry_run_status} = 0 ] || echo \"modprobe: FATAL: Module rdma_rxe not found\" >&2; "
        f"exit {dry_run_status};; esac\n"
        f"echo \"{load_message}\" >&2\nexit 1\n")
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.fast
def test_script_is_executable_and_valid_bash():
    assert os.stat(SCRIPT).st_mode & stat.S_IXUSR
    proc = subprocess.run(["bash", "-n", SCRIPT], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("bash -n passed; shellcheck is not installed")
    proc = subprocess.run([shellcheck, SCRIPT], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.fast
def test_help_says_what_it_does_and_needs():
    proc = run("--help")
    assert proc.returncode == 0, proc.stderr
    for word in ("usage:", "--layout", "netns", "root", "TF_RDMA_TEST_VERBS=1",
                 "rdma_rxe", "Exit status"):
        assert word in proc.stdout, word
    bad = run("--layout", "ring")
    assert bad.returncode == 2
    assert "--layout must be netns or root" in bad.stderr


@pytest.mark.fast
@pytest.mark.skipif(rxe_present(), reason="rdma_rxe exists here: the script "
                    "would set up Soft-RoCE and run the verbs tests")
def test_without_rdma_rxe_it_says_so_and_exits_2():
    before = namespaces()
    for args in ((), ("--check",), ("--layout", "root")):
        proc = run(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert "cannot run the verbs tests on Soft-RoCE here" in proc.stderr
        assert "no rdma_rxe" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
        assert "TF_RDMA_TEST_VERBS" not in proc.stdout  # no test ran
    assert namespaces() == before


@pytest.mark.fast
@pytest.mark.skipif(rxe_present(), reason="rdma_rxe exists here")
def test_a_modprobe_that_cannot_find_rdma_rxe_is_named(tmp_path):
    env = stub_modprobe(tmp_path, 1, "unused")
    proc = run(env=env)
    assert proc.returncode == 2, proc.stderr
    assert "no rdma_rxe" in proc.stderr
    assert "modprobe cannot find it" in proc.stderr


@pytest.mark.fast
@pytest.mark.skipif(rxe_present(), reason="rdma_rxe exists here")
def test_a_failing_modprobe_rdma_rxe_exits_2_and_leaves_nothing(tmp_path):
    # modprobe's dry run finds the module but loading it fails (a locked-
    # down kernel, a container): exit 2 with modprobe's own message.
    env = stub_modprobe(tmp_path, 0,
                        "modprobe: ERROR: could not insert 'rdma_rxe': "
                        "Operation not permitted")
    check = run("--check", env=env)
    if check.returncode != 0:
        pytest.skip("the script's other prerequisites are not met here: "
                    + check.stderr.strip())
    before = namespaces()
    proc = run(env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert ("no rdma_rxe: modprobe rdma_rxe failed: modprobe: ERROR: could "
            "not insert 'rdma_rxe'") in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert namespaces() == before
    assert not [line for line in ip("link", "show").stdout.splitlines()
                if "tfrxa" in line or "tfrxb" in line]


@pytest.mark.skipif(rxe_present(), reason="rdma_rxe exists here")
@pytest.mark.parametrize("layout", ["netns", "root"])
def test_a_setup_that_fails_midway_removes_what_it_made(tmp_path, layout):
    # With a modprobe and an rdma command that only pretend, the script
    # really creates its namespaces, veth pair and (pretended) rxe device,
    # then fails where the real device would be needed (no per-namespace
    # UDP socket; no GID in sysfs): exit 2, and the trap removes all of it.
    env = stub_modprobe(tmp_path, 0, "unused")
    bin_dir = tmp_path / "bin"
    log = tmp_path / "calls.log"
    for name in ("modprobe", "rdma"):
        (bin_dir / name).write_text(
            f"#!/bin/sh\necho \"{name} $*\" >> {log}\n"
            "[ \"$1 $2\" = 'system show' ] && echo 'netns shared'\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    check = run("--check", env=env)
    if check.returncode != 0:
        pytest.skip("the script's other prerequisites are not met here: "
                    + check.stderr.strip())
    before = namespaces()
    proc = run("--layout", layout, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    if "ip netns add" in proc.stderr:
        pytest.skip(f"no network namespaces here: {proc.stderr.strip()}")
    why = ("is not namespace-aware" if layout == "netns" else
           "has no ACTIVE port with the RoCE v2 GID")
    assert why in proc.stderr, proc.stderr
    assert "cleaned up:" in proc.stderr
    calls = log.read_text().splitlines()
    added = [c.split()[3] for c in calls if c.startswith("rdma link add")]
    assert len(added) == 1, calls
    assert f"rdma link delete {added[0]}" in calls
    assert "modprobe -r rdma_rxe" in calls
    assert namespaces() == before
    assert not [line for line in ip("link", "show").stdout.splitlines()
                if "tfrxa" in line or "tfrxb" in line]
