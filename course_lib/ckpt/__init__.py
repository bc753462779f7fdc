"""``course ckpt``: a run's checkpoints out of the kit, whatever wrote them.

| module | holds |
| --- | --- |
| ``runs`` | a run folder's checkpoints: find, verify, pick a step, read the full weights of any format |
| ``listing`` | ``course ckpt list``: the table, and which checkpoint ``--resume auto`` would take |
| ``write`` | ``consolidate`` (one ``.safetensors`` + its config) and ``export_hf`` (a ``from_pretrained`` folder) |
| ``cli`` | the ``course ckpt`` command family |

A front door (the layer of ``planner``, ``launchers``): it reads the checkpoint formats of
``checkpoint/`` and of ``parallel/`` (DeepSpeed's), and the trainer's config, so it cannot sit
below them. The name mapping and ``model.init_from`` live in ``model/`` (``hf_map``,
``hf_weights``, ``init_source``), which the trainer uses too.
"""
