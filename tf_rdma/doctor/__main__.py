"""``python -m tf_rdma.doctor``: the doctor on its own (as ``tf-rdma doctor``)."""

import sys

from tf_rdma.doctor.command import main

sys.exit(main())
