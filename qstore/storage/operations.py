"""An operation of the public API: its body, its transaction policy and its argument checks.

The storage API is one declarative list of :class:`Operation` objects (see
:class:`qstore.storage.Operations`). Both faces read the same list:
:class:`qstore.QueueStorage` binds each operation to a synchronous target,
:class:`qstore.aio.AsyncQueueStorage` to an async one (running the same bound call in a
greenlet on the async target's synchronous counterpart), so the two faces cannot differ in
what an operation does or in the transaction it gets. The descriptor's ``__get__`` is
typed per face: mypy sees ``(target, *args) -> R`` on the sync face and
``(async_target, *args) -> Awaitable[R]`` on the async one, with the body's own argument
names and types.

A body is a plain function ``body(ctx, conn, *args)`` over a ``Connection`` (or, for
``Policy.UNITS``, a :class:`~qstore.storage.targets.Transactions`); it never begins, commits
or rolls back anything.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from sqlalchemy import Engine
from sqlalchemy.util.concurrency import greenlet_spawn

from qstore.errors import DatabaseError, translated
from qstore.storage.context import StorageContext
from qstore.storage.targets import (
    AsyncTarget,
    Policy,
    Target,
    refuse_callers_transaction,
    run,
    statement_on_engine,
    sync_target,
)

if TYPE_CHECKING:
    from qstore.storage.checks import Check

__all__ = ["AsyncFace", "Operation", "SyncFace", "op"]

P = ParamSpec("P")
R = TypeVar("R")


class SyncFace:
    """Base of a face whose operations take ``Engine`` / ``Connection`` / ``Session``."""

    def _bind_operation(self, operation: Operation[Any, Any]) -> Any:
        raise NotImplementedError


class AsyncFace:
    """Base of a face whose operations are coroutines over async targets."""

    def _bind_operation(self, operation: Operation[Any, Any]) -> Any:
        raise NotImplementedError


class Operation(Generic[P, R]):
    """One public operation (see the module docstring). ``checks`` maps argument names to
    :mod:`qstore.storage.checks` functions; each runs on its argument before the body."""

    def __init__(self, policy: Policy, body: Callable[Concatenate[StorageContext, Any, P], R],
                 checks: dict[str, Check]) -> None:
        self.policy = policy
        self.body = body
        self.name = body.__name__
        self.__doc__ = body.__doc__
        signature = inspect.signature(body)
        params = list(signature.parameters.values())[2:]
        positions = {p.name: i for i, p in enumerate(params)}
        unknown = set(checks) - positions.keys()
        if unknown:  # pragma: no cover - a mistake in the operation list
            raise TypeError(f"{body.__name__} has no argument {sorted(unknown)}")
        self.parameters = tuple(p.name for p in params)
        target = inspect.Parameter("target", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="Target")
        self.signature = inspect.Signature([target, *params], return_annotation=signature.return_annotation)
        self._checks = tuple((positions[name], name, check) for name, check in checks.items())

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def alias(self) -> Operation[P, R]:
        """The same operation under another name (the seed's ``*_in_tx`` / ``*_tx`` names)."""
        twin: Operation[P, R] = Operation(self.policy, self.body, {})
        twin._checks = self._checks
        return twin

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Run the argument checks; returns the normalised arguments."""
        if not self._checks:
            return args, kwargs
        values = list(args)
        for position, name, check in self._checks:
            if position < len(values):
                values[position] = check(values[position], name)
            elif name in kwargs:
                kwargs[name] = check(kwargs[name], name)
        return tuple(values), kwargs

    def bind(self, ctx: StorageContext) -> Callable[..., R]:
        """The synchronous call of this operation for one install."""
        policy, body, check, name = self.policy, self.body, self.check, self.name
        schema = ctx.config.schema
        checked = bool(self._checks)
        # a STATEMENT operation on an Engine skips run()'s dispatch (see statement_on_engine)
        hot = policy is Policy.STATEMENT

        def call(target: Target, *args: Any, **kwargs: Any) -> R:
            if checked:
                args, kwargs = check(args, kwargs)
            try:
                if hot and isinstance(target, Engine):
                    return statement_on_engine(target, body, ctx, args, kwargs)
                return run(policy, target, lambda conn: body(ctx, conn, *args, **kwargs), name)
            except Exception as err:
                mapped = translated(err, schema)
                if isinstance(mapped, DatabaseError):
                    mapped.failed_in(name)
                if mapped is err:
                    raise
                raise mapped from err

        return self._named(call)

    def bind_async(self, ctx: StorageContext) -> Callable[..., Coroutine[Any, Any, R]]:
        """The async call: the synchronous one, run in a greenlet on the async target's
        synchronous counterpart (so the policy applies exactly as on the sync face)."""
        sync_call = self.bind(ctx)
        check, policy, name = self.check, self.policy, self.name

        async def call(target: AsyncTarget, *args: Any, **kwargs: Any) -> R:
            args, kwargs = check(args, kwargs)
            # before the async target is started: a refusal sends nothing
            refuse_callers_transaction(policy, target, name)
            return await greenlet_spawn(sync_call, await sync_target(target), *args, **kwargs)

        return self._named(call)

    def _named(self, call: Any) -> Any:
        call.__name__ = call.__qualname__ = self.name
        call.__doc__ = self.__doc__
        call.__signature__ = self.signature
        return call

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Operation[P, R]: ...
    @overload
    def __get__(self, obj: SyncFace, owner: type[Any]) -> Callable[Concatenate[Target, P], R]: ...
    @overload
    def __get__(self, obj: AsyncFace, owner: type[Any]
                ) -> Callable[Concatenate[AsyncTarget, P], Coroutine[Any, Any, R]]: ...

    def __get__(self, obj: Any, owner: type[Any]) -> Any:
        if obj is None:
            return self
        bound = obj._bind_operation(self)
        obj.__dict__[self.name] = bound  # later lookups skip the descriptor
        return bound


def op(policy: Policy, body: Callable[Concatenate[StorageContext, Any, P], R], /,
       **checks: Check) -> Operation[P, R]:
    """Declare an operation: ``body`` under ``policy``, each named argument checked first."""
    return Operation(policy, body, checks)
