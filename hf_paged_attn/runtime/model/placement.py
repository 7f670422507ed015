"""Where a model's layers execute, for models spread over devices by accelerate.

``from_pretrained(..., device_map=...)`` attaches accelerate hooks (``module._hf_hook``) that move
each module's inputs, and its offloaded weights, to the module's *execution device* at forward
time. Parameters of offloaded modules sit on ``meta`` (disk) or stay on the CPU, so neither
``model.device`` nor a parameter's device says where a layer runs: the hooks do. The cache creates
each layer's pages lazily on the device its keys arrive on, so these helpers only serve what must
be known before the first step: the device the engine builds step tensors on, and the devices
that hold layers (``memory.py`` sizes the cache for them).
"""

from __future__ import annotations

import torch

from ...core.layers import LayerKinds


def hook_device(module: torch.nn.Module) -> torch.device | None:
    """The execution device of the accelerate hook on ``module`` itself, or None without one.
    (A ``SequentialHook`` holds several hooks; the first that names a device wins.)"""
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
        device = getattr(h, "execution_device", None)
        if device is not None:
            return as_device(device)
    return None


def as_device(device: torch.device | str | int) -> torch.device:
    """accelerate's way of naming a device (an int is an accelerator index) as a torch.device;
    "cpu:0" (what ``PartialState`` names the CPU) becomes "cpu", the device CPU tensors report."""
    if isinstance(device, int):
        accelerator = torch.accelerator.current_accelerator()
        device = torch.device(accelerator.type if accelerator else "cuda", device)
    device = torch.device(device)
    return torch.device("cpu") if device.type == "cpu" else device


def own_device(module: torch.nn.Module) -> torch.device | None:
    """The device of the first parameter or buffer that is not on ``meta`` (None when all are)."""
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return None


def module_devices(model: torch.nn.Module) -> dict[str, torch.device | None]:
    """Execution device of every named module: its own hook's, else the nearest ancestor's (accelerate
    may hook a whole block only). None where no hook says anything."""
    devices: dict[str, torch.device | None] = {}
    for name, module in model.named_modules():  # parents come before their children
        parent = devices.get(name.rpartition(".")[0]) if name else None
        devices[name] = hook_device(module) or parent
    return devices


def input_device(model: torch.nn.Module) -> torch.device:
    """Where the model wants its ``input_ids``: the execution device of the input embeddings (the
    top module's hook moves outputs back to it), else the model's own device. Cheap unless accelerate
    hooked an ancestor of the embeddings only (then every module is visited once)."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # not a transformers model, or one without embeddings
        embeddings = None
    device = None
    if embeddings is not None:
        device = hook_device(embeddings)
        if device is None and getattr(model, "hf_device_map", None) is not None:
            hooked = module_devices(model)
            device = next((hooked[name] for name, m in model.named_modules() if m is embeddings), None)
        device = device or own_device(embeddings)
    device = device or hook_device(model) or own_device(model)
    return device if device is not None else torch.device("cpu")


def layer_devices(model: torch.nn.Module) -> list[torch.device]:
    """Execution device of each decoder layer (index = ``layer_idx``), where its pages will live.

    Layers are found through the modules carrying an int ``layer_idx`` (transformers' attention
    modules); a layer none of them names falls back to :func:`input_device`."""
    num_layers = model.config.get_text_config().num_hidden_layers
    fallback = input_device(model)
    hooked = module_devices(model)
    devices: list[torch.device | None] = [None] * num_layers
    for name, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and 0 <= idx < num_layers and devices[idx] is None:
            devices[idx] = hooked[name] or own_device(module)
    return [d if d is not None else fallback for d in devices]


def layer_kinds(model: torch.nn.Module, hybrid_kv: bool) -> LayerKinds:
    """The attention groups an engine gives ``model``: per-group tables (``hybrid_kv``) need every
    layer on one device, since the groups share page tensors."""
    return LayerKinds.from_config(model.config, share_pages=hybrid_kv and len(set(layer_devices(model))) == 1)


def offloaded_to(model: torch.nn.Module) -> set[str]:
    """What accelerate's ``device_map`` puts modules on, as strings ("cpu", "disk", "0", ...); empty without one."""
    return {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}


def kernel_device(model: torch.nn.Module) -> torch.device:
    """The device ``kernel="auto"`` is resolved for: the layers' device when they all run on one
    device type (several GPUs count as one type), else the CPU, whose choice (the torch backend)
    is the one that runs on every device."""
    devices = sorted(set(layer_devices(model)), key=str)
    return devices[0] if len({d.type for d in devices}) == 1 else torch.device("cpu")
