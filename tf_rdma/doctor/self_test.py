"""``tf-rdma doctor --self-test``: an RDMA write through a loopback queue pair.

On a machine with an active port: one RC queue pair connected to itself, a
source region with a pattern, a destination region registered for remote
write, one signalled RDMA WRITE of 1 MiB, and a byte-by-byte comparison.
"""

import time

from tf_rdma.doctor.rdma import usable_ports

__all__ = ["SELF_TEST_BYTES", "self_test"]

#: Bytes the self-test writes through the loopback queue pair.
SELF_TEST_BYTES = 1 << 20


def self_test(pyverbs, devices, nbytes=SELF_TEST_BYTES, timeout_s=5.0):
    """Writes ``nbytes`` through a loopback RC queue pair and checks them.

    The first active port is used: one RC QP connected to itself, a source
    region with a pattern, a destination region registered for remote
    write, one signalled RDMA WRITE, and a byte-by-byte comparison.

    Args:
        pyverbs: The pyverbs module, or None.
        devices: The device list from :func:`rdma_devices`.
        nbytes: Bytes to write (default 1 MiB).
        timeout_s: How long to wait for the completion.

    Returns:
        A dict with ``ran`` (bool), ``ok`` (True, False, or None when it did
        not run), ``device``, ``port``, ``bytes``, ``seconds`` and ``reason``
        (why it did not run or failed; None on success).
    """
    result = {"ran": False, "ok": None, "device": None, "port": None, "bytes": nbytes,
              "seconds": None, "reason": None}
    if pyverbs is None:
        result["reason"] = "pyverbs is not importable"
        return result
    usable = usable_ports(devices)
    if not usable:
        result["reason"] = "no RDMA port in state ACTIVE"
        return result
    dev, port = usable[0]
    result.update(ran=True, device=dev["name"], port=port["port"])
    from pyverbs import enums as e  # pylint: disable=import-outside-toplevel
    from pyverbs.addr import AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, SendWR
    pattern = bytes((i * 7 + 13) & 0xFF for i in range(nbytes))
    start = time.monotonic()
    try:
        with Context(name=dev["name"]) as ctx:
            pd = PD(ctx)
            cq = CQ(ctx, 16)
            cap = QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=1, max_recv_sge=1)
            qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=1))
            access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
            src = MR(pd, nbytes, e.IBV_ACCESS_LOCAL_WRITE)
            dst = MR(pd, nbytes, access)
            src.write(pattern, nbytes)
            dst.write(bytes(nbytes), nbytes)

            attr = QPAttr(qp_state=e.IBV_QPS_INIT)
            attr.port_num = port["port"]
            attr.pkey_index = 0
            attr.qp_access_flags = access
            qp.to_init(attr)

            if port["link_layer"] == "Ethernet":
                gids = [g for g in port["gids"] if g["type"] == "RoCE v2"] or port["gids"]
                if not gids:
                    raise RuntimeError(f"port {port['port']} of {dev['name']} has no GID")
                gid_index = gids[0]["index"]
                route = GlobalRoute(dgid=ctx.query_gid(port["port"], gid_index),
                                    sgid_index=gid_index, hop_limit=64)
                ah = AHAttr(gr=route, is_global=1, port_num=port["port"], dlid=0)
            else:
                ah = AHAttr(port_num=port["port"], dlid=port["lid"])
            attr.ah_attr = ah
            attr.path_mtu = int(ctx.query_port(port["port"]).active_mtu)
            attr.dest_qp_num = qp.qp_num
            attr.rq_psn = 0
            attr.max_dest_rd_atomic = 1
            attr.min_rnr_timer = 12
            qp.to_rtr(attr)
            attr.sq_psn = 0
            attr.timeout = 14
            attr.retry_cnt = 7
            attr.rnr_retry = 7
            attr.max_rd_atomic = 1
            qp.to_rts(attr)

            wr = SendWR(wr_id=1, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                        sg=[SGE(src.buf, nbytes, src.lkey)], send_flags=e.IBV_SEND_SIGNALED)
            wr.set_wr_rdma(dst.rkey, dst.buf)
            qp.post_send(wr)
            deadline = time.monotonic() + timeout_s
            while True:
                polled, wcs = cq.poll()
                if polled:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no completion within {timeout_s} s")
            if wcs[0].status != e.IBV_WC_SUCCESS:
                raise RuntimeError(f"work completion status {wcs[0].status}")
            got = dst.read(nbytes, 0)
            if got != pattern:
                first = next(i for i in range(nbytes) if got[i] != pattern[i])
                raise RuntimeError(f"data mismatch at byte {first}")
            for obj in (qp, src, dst, cq, pd):
                obj.close()
        result["ok"] = True
    except Exception as err:  # noqa: BLE001 - any verbs failure is the report
        result["ok"] = False
        result["reason"] = f"{type(err).__name__}: {err}"
    result["seconds"] = round(time.monotonic() - start, 6)
    return result
