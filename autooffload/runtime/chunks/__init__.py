"""Chunks: how params are packed (``layout``), where the bytes live and move (``store``, ``host``,
``transfers``) and how their gradients leave the device (``grad_offload``)."""
