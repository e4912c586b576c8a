"""Shared helpers of the ops: input checks, fixed-order reductions, provider resolution."""

from __future__ import annotations

import re
from typing import Any

import torch

from rl_engine.registry import Provider

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(name: str, t: Any, *, dims: int | tuple[int, ...] | None = None) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``t`` is a tensor of the right rank."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dims is not None:
        allowed = (dims,) if isinstance(dims, int) else dims
        if t.dim() not in allowed:
            raise ValueError(
                f"{name} must have {' or '.join(map(str, allowed))} dims, got shape {tuple(t.shape)}"
            )


def check_tensors(dims: int | tuple[int, ...] | None = None, /, **tensors: Any) -> None:
    """:func:`check_tensor` of each of ``tensors`` (by name, in order), all of rank ``dims``."""
    for name, t in tensors.items():
        check_tensor(name, t, dims=dims)


def check_float(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> None:
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; expected one of {list(dtypes)}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    devs = {n: t.device for n, t in tensors.items() if t is not None}
    if len(set(devs.values())) > 1:
        desc = ", ".join(f"{n} on {d}" for n, d in devs.items())
        raise ValueError(f"expected all tensors on one device, got {desc}")


def check_same_dtype(**tensors: torch.Tensor | None) -> None:
    dts = {n: t.dtype for n, t in tensors.items() if t is not None}
    if len(set(dts.values())) > 1:
        desc = ", ".join(f"{n}: {d}" for n, d in dts.items())
        raise TypeError(f"expected one dtype, got {desc}")


def as_bool_mask(op: str, mask: torch.Tensor) -> torch.Tensor:
    """A public entry's mask as bool: bool as is; numbers must be 0 or 1 (a 2.0 or a -1 is a bug
    upstream, e.g. a summed or shifted mask, not a real token). On the CPU the values are
    checked at once; on an accelerator a device-side assert is queued (a host check would
    synchronise the stream): a bad value then fails the stream instead of giving a silent
    result."""
    if mask.dtype == torch.bool:
        return mask
    ok_vals = (mask == 0) | (mask == 1)
    msg = f"{op}: a numeric mask must hold 0 or 1 only (dtype {mask.dtype})"
    if mask.device.type == "cpu":
        if not bool(ok_vals.all()):
            bad = mask[~ok_vals].flatten()[:3].tolist()
            raise ValueError(f"{msg}; found {bad}")
    elif mask.numel():
        torch._assert_async(ok_vals.all(), msg)
    return mask != 0


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` in a fixed pairwise order that depends only on ``x.shape[dim]``.

    The length is zero-padded to a power of two ``L``; then, repeatedly, element ``i`` of the
    first half is added to element ``i`` of the second half. Each step is an elementwise add
    (exact IEEE, no reassociation), so every output element is computed by the same sequence of
    operations whatever the other dimensions are: the sum is invariant to batch size, position
    and the contents of other rows by construction.
    """
    dim = dim % x.dim()
    n = x.shape[dim]
    if n == 0:
        return x.sum(dim)  # exact: empty sum is zero
    length = 1 << (n - 1).bit_length()
    if length != n:
        pad_shape = list(x.shape)
        pad_shape[dim] = length - n
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    while length > 1:
        length //= 2
        x = x.narrow(dim, 0, length) + x.narrow(dim, length, length)
    return x.squeeze(dim)


def device_of(*tensors: torch.Tensor | None) -> torch.device:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


ALL_DEVICES = ("cpu", "cuda", "rocm")


def native_provider(*, op: str, numerics: str, fn: Any, **fields: Any) -> Provider:
    """The op's PyTorch reference as its ``native`` provider: every device, the float dtypes,
    invariant (``fields``: ``extras``, ``version``)."""
    return Provider(op=op, name="native", devices=ALL_DEVICES, dtypes=FLOAT_DTYPES,
                    invariant=True, numerics=numerics, fn=fn, **fields)  # fmt: skip


def stock_provider(*, op: str, numerics: str, fn: Any, **fields: Any) -> Provider:
    """What the engines run today, as the ``stock`` provider: every device, not invariant."""
    return Provider(op=op, name="stock", devices=ALL_DEVICES, dtypes=FLOAT_DTYPES,
                    invariant=False, numerics=numerics, fn=fn, **fields)  # fmt: skip


def register_op(
    op: str,
    *,
    entry: Any,
    native: tuple,
    stock: tuple | None = None,
    extras: tuple[str, ...] | dict[str, str] = (),
    fn: str | None = None,
) -> None:
    """Declare ``op`` with its public ``entry`` and its providers, in resolution order: the
    PyTorch reference (``native``: ``(numerics, module)``, the op's ``reference`` module; its
    function ``fn``, default ``op``, is also the op's reference, the spec), then what the
    engines run today (``stock``: ``(numerics, module)``, a module with the same function
    names). ``extras``: the providers' further functions, by key, the same in both modules: a
    key ``k`` is the module's ``<fn>_<k>`` (``"backward"``: ``rms_norm_backward``), or a mapping
    gives key -> function name where the name is another. The Triton provider is added last,
    by :func:`register_triton` at the end of the op's package.

    ``native`` / ``stock`` may also be given as ``(numerics, fn, extras)`` (the functions
    themselves, no ``extras`` / ``fn`` arguments): the form of the ops that still spell them out
    (``moe_experts``)."""
    from rl_engine.registry import KernelRegistry

    fn = fn or op
    names = extras if isinstance(extras, dict) else {k: f"{fn}_{k}" for k in extras}

    def functions(spec: tuple) -> tuple:
        if len(spec) == 3:
            return spec
        numerics, module = spec
        return numerics, getattr(module, fn), {k: getattr(module, n) for k, n in names.items()}

    numerics, ref, ref_extras = functions(native)
    KernelRegistry.register_op(op, entry=entry, reference=ref)
    KernelRegistry.register_provider(
        native_provider(op=op, numerics=numerics, fn=ref, extras=ref_extras)
    )
    if stock is not None:
        numerics, stock_fn, stock_extras = functions(stock)
        KernelRegistry.register_provider(
            stock_provider(op=op, numerics=numerics, fn=stock_fn, extras=stock_extras)
        )


def _schema_stub(fn: Any, *, drop_first: bool, returns: bool, placeholders: tuple[str, ...]) -> Any:
    """A stub with ``fn``'s signature for schema inference only: less its first parameter
    (``drop_first``: a ``call``'s provider), no defaults (the op takes every argument
    positionally; the entry resolves the defaults), a ``Tensor`` return (``returns``: the op
    states its own) and ``Tensor`` for the ``placeholders`` (arguments whose schema text the op
    states itself)."""
    import inspect

    sig = inspect.signature(fn, eval_str=True)
    params = list(sig.parameters.values())[1 if drop_first else 0 :]
    params = [
        p.replace(
            default=inspect.Parameter.empty,
            annotation=torch.Tensor if p.name in placeholders else p.annotation,
        )
        for p in params
    ]
    ret = torch.Tensor if returns else sig.return_annotation

    def stub(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    stub.__signature__ = sig.replace(parameters=params, return_annotation=ret)  # type: ignore[attr-defined]
    return stub


def contiguous_outputs(out: Any) -> Any:
    """``out`` (a tensor or a tuple of them) with every tensor contiguous, as a fake's
    ``torch.empty`` outputs are (a provider may return a strided result)."""
    if isinstance(out, torch.Tensor):
        return out.contiguous()
    return tuple(o.contiguous() for o in out)


def provider_op(
    op: str,
    name: str,
    spec: Any,
    fake: Any,
    extra: str | None = None,
    *,
    call: Any = None,
    contiguous: bool = False,
    mutates_args: tuple[str, ...] = (),
    returns: str | None = None,
    arg_types: dict[str, str] | None = None,
) -> Any:
    """The custom op ``rl_engine::<name>`` of ``op``'s providers: the one way every op (but
    ``det_gemm.tp``'s, see docs/where-things-live.md) defines its custom ops.

    Its schema is ``spec``'s signature (the reference function whose arguments every provider
    of ``op`` takes, in order) plus a last ``provider: str``; its body runs that provider's
    ``fn`` (``extra=None``) or ``extras[extra]`` with the other arguments, and ``fake`` (the same
    arguments, no provider) gives torch.compile the outputs' metadata. What is particular to
    an op (which tensors its autograd saves, how its entry checks and normalises arguments)
    stays in the op's package.

    Args:
        call: the body, where the op does more than pass its arguments on (another order, a
            switch between the provider's functions, outputs fixed up): ``call(p, *args)``
            with ``p`` the :class:`~rl_engine.registry.Provider` and ``args`` the op's
            arguments; it picks the provider's function itself (``extra`` stays None). With
            ``spec=None`` the schema is ``call``'s signature less ``p``.
        contiguous: the outputs made contiguous (:func:`contiguous_outputs`).
        mutates_args: the arguments the op writes; such an op returns nothing (what the
            provider returns is dropped).
        returns: the schema's return type where the annotation cannot say it (a
            variable-length tuple).
        arg_types: an argument's schema type where the op's is narrower than the spec's
            (``{"scale": "float"}``: the reference also takes ``None``, the op gets the value
            the entry resolved), or, given as ``"type name, ..."``, the arguments the op takes
            in its place (a value no schema type carries, sent as scalars that ``call`` turns
            back: ``rope``'s scaling dict).
    """
    from rl_engine.registry import KernelRegistry

    if call is not None and extra is not None:
        raise ValueError(f"provider_op {name}: call picks the provider's function; no extra")
    arg_types = arg_types or {}
    stub = _schema_stub(
        call if spec is None else spec,
        drop_first=spec is None,
        returns=returns is not None,
        placeholders=tuple(arg_types),
    )
    args, ret = torch.library.infer_schema(stub, mutates_args=mutates_args).rsplit(") -> ", 1)
    ret = returns or ret
    for arg, typ in arg_types.items():
        text = typ if " " in typ else f"{typ} {arg}"
        args, n = re.subn(rf"Tensor {arg}(?=,|$)", text, args)
        if n != 1:
            raise ValueError(f"provider_op {name}: no argument {arg!r} in {args})")
    schema = f"{args}, str provider) -> {ret}"

    returns_nothing = ret.strip() == "()"  # a mutating op: what the provider returns is dropped

    def body(*args: Any) -> Any:
        *rest, provider = args
        p = KernelRegistry.provider(op, provider)
        if call is not None:
            out = call(p, *rest)
        else:
            out = (p.fn if extra is None else p.extras[extra])(*rest)
        if returns_nothing:
            return None
        return contiguous_outputs(out) if contiguous else out

    body.__name__ = body.__qualname__ = f"{name}_op"
    custom = torch.library.custom_op(
        f"rl_engine::{name}", body, mutates_args=mutates_args, schema=schema
    )

    @custom.register_fake
    def _(*args: Any) -> Any:
        return fake(*args[:-1])

    return custom


def register_triton(package: str, *also: str) -> None:
    """The Triton provider of ``package`` (its ``triton`` module's ``PROVIDER``): first choice
    on the GPU (the CPU runs it through the interpreter). ``also``: more provider names of that
    module, registered after it. Called at the end of the op's package: the module imports what
    the package defines."""
    from importlib import import_module

    from rl_engine.registry import KernelRegistry

    mod = import_module(f"{package}.triton")
    KernelRegistry.register_provider(mod.PROVIDER, first=True)
    for name in also:
        KernelRegistry.register_provider(getattr(mod, name))


def lse_reduction_ops(
    op: str, forward: Any, backward: Any, check: Any, *, saves_value: bool = False
) -> tuple[Any, Any]:
    """The custom ops ``rl_engine::<op>`` and ``rl_engine::<op>_backward`` of a vocabulary
    reduction (``logp``, ``entropy``) and their autograd, in one place for those ops.

    ``forward(logits, *more_tensors, temperature) -> (value, lse)`` (fp32 [T] each; the
    providers' ``forward`` extra) and ``backward(logits, *more_tensors, temperature, lse,
    [value,] grad) -> dlogits`` (their ``backward`` extra) are the reference functions that
    give the schemas (:func:`provider_op`); ``check`` (the forward's arguments) validates them
    in the fake. Autograd saves the tensor inputs and ``lse`` (and ``value`` where
    ``saves_value``: the entropy's gradient needs it); ``lse`` is not differentiable; only
    ``logits`` gets a gradient, computed only where it needs one.
    """

    def forward_fake(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        check(*args)
        logits, t = args[0], args[0].shape[0]
        return logits.new_empty(t, dtype=torch.float32), logits.new_empty(t, dtype=torch.float32)

    def backward_fake(logits: torch.Tensor, *args: Any) -> torch.Tensor:
        return torch.empty_like(logits)

    forward_op = provider_op(op, op, forward, forward_fake, "forward")
    backward_op = provider_op(op, f"{op}_backward", backward, backward_fake, "backward")

    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        *tensors, temperature, provider = inputs
        value, lse = output
        ctx.save_for_backward(*tensors, lse, *((value,) if saves_value else ()))
        ctx.n_tensors = len(tensors)
        ctx.temperature = temperature
        ctx.provider = provider
        ctx.mark_non_differentiable(lse)

    def grad_fn(ctx: Any, grad: torch.Tensor, _grad_lse: torch.Tensor) -> tuple:
        saved, n = ctx.saved_tensors, ctx.n_tensors
        dlogits = None
        if ctx.needs_input_grad[0]:
            dlogits = backward_op(*saved[:n], ctx.temperature, *saved[n:], grad, ctx.provider)
        return (dlogits,) + (None,) * (n + 1)

    forward_op.register_autograd(grad_fn, setup_context=setup_context)
    return forward_op, backward_op


def signature_of(spec: Any, *lead: str, replaces: int = 0) -> Any:
    """Decorator: a provider function written ``fn(*args)`` gets the signature of ``spec`` (its
    op's reference, which every provider keeps and the registry checks) instead of spelling the
    argument list out again. ``lead``: tensor arguments before ``spec``'s (a backward's upstream
    gradient), in place of ``spec``'s first ``replaces`` ones (``rope_backward``'s ``grad`` for
    ``rope``'s ``x``); the return annotation stays ``fn``'s, and so do ``fn``'s own keyword-only
    parameters, after ``spec``'s (a provider's tuning knobs, e.g. a benchmark's launch
    overrides). A positional call is passed on with the omitted trailing defaults appended (no
    binding on the hot path); keyword calls and wrong counts are bound to positions first, as a
    function with that signature binds them (a wrong call raises the same ``TypeError``)."""
    import functools
    import inspect

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(n, kind, annotation="torch.Tensor") for n in lead]
    params += list(inspect.signature(spec).parameters.values())[replaces:]

    def wrap(fn: Any) -> Any:
        own = inspect.signature(fn)
        knobs = [p for p in own.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
        sig = inspect.Signature(params + knobs, return_annotation=own.return_annotation)
        n = len(params)
        defaults = tuple(p.default for p in params)
        n_required = sum(p.default is inspect.Parameter.empty for p in params)

        @functools.wraps(fn)
        def provider(*args: Any, **kwargs: Any) -> Any:
            if not kwargs and n_required <= len(args) <= n:
                args += defaults[len(args) :]
            else:
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                args, kwargs = bound.args, bound.kwargs
            return fn(*args, **kwargs)

        provider.__signature__ = sig  # type: ignore[attr-defined]
        return provider

    return wrap


def entry_arguments(public: Any) -> Any:
    """For an op's registry entry, called as its ``public`` function but with the provider
    given instead of ``backend``: a function that binds ``(*args, **kwargs)`` as ``public``
    (less ``backend``) binds them, defaults applied, and returns the arguments by name in
    ``public``'s order (a wrong call raises ``public``'s ``TypeError``)."""
    import inspect

    sig = inspect.signature(public)
    sig = sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "backend"])

    def bind(*args: Any, **kwargs: Any) -> dict[str, Any]:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    return bind


def registry_entry(public: Any, run: Any) -> Any:
    """An op's registry entry (what :meth:`rl_engine.registry.KernelRegistry.get_op`'s ``Op``
    calls), for a ``public`` function that ends in ``run(*arguments, provider)``: called as
    ``public`` but with ``provider=`` (the resolved name) instead of ``backend``, it binds the
    arguments as ``public`` does (:func:`entry_arguments`: defaults applied, a wrong call raises
    ``public``'s ``TypeError``) and returns ``run`` of them, in ``public``'s order, and the
    provider. ``public`` calls ``run`` itself, so no binding runs on the public path."""
    bind = entry_arguments(public)

    def entry(*args: Any, provider: str, **kwargs: Any) -> Any:
        return run(*bind(*args, **kwargs).values(), provider)

    return entry
