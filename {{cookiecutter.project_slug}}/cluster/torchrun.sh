#!/usr/bin/env bash
# Multi-node DDP with torchrun: run the same command on every node (by hand, pdsh, or your scheduler).
#   NNODES=2 GPUS_PER_NODE=8 RDZV_ENDPOINT=node0:29400 RDZV_ID=run1 bash cluster/torchrun.sh [main.py options]
# torchrun's c10d rendezvous (hosted on RDZV_ENDPOINT, any node every node can reach) assigns node and
# global ranks; Lightning reads them from torchrun's environment (TorchElasticEnvironment) and must be
# told the same shape: --trainer.num_nodes = --nnodes, --trainer.devices = --nproc_per_node.
# The run lives in runs/<RDZV_ID> (on a file system every node shares): the same command started again
# (by you or a scheduler) continues it from its newest complete checkpoint (--ckpt_path auto).
# When a process fails (an error, a kill, a hang past --dist_timeout), torchrun stops this node's others,
# every node's agent meets at the rendezvous again, and all start anew, resuming the same way: at most
# MAX_RESTARTS times per node, then the job fails. The rendezvous lives in the agent on RDZV_ENDPOINT's host,
# so it survives the restarts of processes, not the loss of that node.
set -euo pipefail
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-1}
RDZV_ENDPOINT=${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port, the same on every node}
RDZV_ID=${RDZV_ID:-train}
MAX_RESTARTS=${MAX_RESTARTS:-3}
# The processes' own store (rank 0's, new for every start) rather than the rendezvous' store: a restart
# then cannot read the previous start's addresses (with the shared store 2 gloo ranks failed to connect to
# dead ports twice before a restart got through; pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# `python -m torch.distributed.run` is `torchrun`, with the same interpreter as `python`.
exec python -m torch.distributed.run \
    --nnodes "$NNODES" \
    --nproc_per_node "$GPUS_PER_NODE" \
    --max-restarts "$MAX_RESTARTS" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$RDZV_ENDPOINT" \
    --rdzv-id "$RDZV_ID" \
    main.py fit \
    --trainer.num_nodes "$NNODES" \
    --trainer.devices "$GPUS_PER_NODE" \
    --trainer.default_root_dir "runs/$RDZV_ID" \
    --ckpt_path auto \
    "$@"
