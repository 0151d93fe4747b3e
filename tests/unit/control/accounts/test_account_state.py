"""Accounts' state (issue 36) in the store, on SQLite and PostgreSQL: what a key of an account in each state
gets, which moves are allowed, the first account protected, keys removed with the move to ``deleting``."""

from __future__ import annotations

import pytest

from sbx.control.accounts.keys import DEFAULT_ACCOUNT, Accounts
from sbx.control.errors import ControlError
from sbx.control.store.database import Store


def _code(fn, *args) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(ControlError) as e:
        fn(*args)
    return str(e.value.code)


def test_keys_and_starts_follow_the_accounts_state(store: Store) -> None:
    accounts = Accounts(store, ["trial", "team", "unlimited"])
    accounts.bootstrap("sbx_admin_token")
    row, _key, token = accounts.create_account("hana", "team")
    assert row.state == "active" and row.state_changed_at is None
    assert accounts.authenticate(token) is not None and accounts.require_active(row.id).id == row.id

    suspended, old = accounts.set_state(row.id, "suspended", ("active",))
    assert (suspended.state, old) == ("suspended", "active") and suspended.state_changed_at is not None
    assert _code(accounts.authenticate, token) == "account_suspended"
    assert _code(accounts.require_active, row.id) == "account_suspended"
    assert [r.id for r in accounts.list_in_state("suspended")] == [row.id]
    assert accounts.set_state(row.id, "suspended", ("active",))[1] == "suspended"  # again: nothing changes

    assert accounts.set_state(row.id, "active", ("suspended",))[0].state == "active"
    assert accounts.authenticate(token) is not None

    accounts.set_state(row.id, "deleting", ("active", "suspended"))
    assert accounts.authenticate(token) is None and accounts.list_keys(row.id) == []
    assert _code(accounts.require_active, row.id) == "account_deleted"
    assert _code(accounts.set_state, row.id, "suspended", ("active",)) == "account_deleted"
    assert _code(accounts.create_key, row.id, "more") == "account_deleted"
    assert accounts.set_state(row.id, "deleted", ("deleting",))[0].state == "deleted"
    assert accounts.get_account(row.id).state == "deleted"  # the row stays, for the usage report

    assert _code(accounts.set_state, DEFAULT_ACCOUNT, "suspended", ("active",)) == "protected_account"
    assert _code(accounts.set_state, "acct_nope", "suspended", ("active",)) == "not_found"
    assert accounts.authenticate("sbx_admin_token") is not None
