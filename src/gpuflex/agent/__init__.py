"""The provider agent: the daemon on a GPU/CPU box. It only connects outward, to the coordinator.

- ``hardware``   probe CPU, RAM and GPUs (through torch.cuda when present)
- ``benchmark``  a short matmul / memory-bandwidth benchmark: the speed the market ranks by
- ``sandbox``    run task code in a subprocess: scrubbed environment, resource limits, own process group
- ``daemon``     register, heartbeat, lease, run, report; drain on SIGTERM
- ``runner``     the entry point inside the task subprocess: hands the lease to ``gpuflex.train``, or a
                 deployment's ``server`` task to ``server``
- ``server``     a deployment's replica: the model from the node's cache, one engine, the outbound relay
"""
