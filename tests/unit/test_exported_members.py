"""The public API is exactly what ``__all__`` says, and every name in it exists."""

import ledger_cdc


def test_all_names_exist_and_are_public() -> None:
    for name in ledger_cdc.__all__:
        assert hasattr(ledger_cdc, name), name
    assert sorted(ledger_cdc.__all__) == ledger_cdc.__all__


def test_nothing_public_is_left_out_of_all() -> None:
    public = {
        n
        for n in dir(ledger_cdc)
        if not n.startswith("_") and not isinstance(getattr(ledger_cdc, n), type(ledger_cdc))
    }
    assert public <= set(ledger_cdc.__all__), public - set(ledger_cdc.__all__)
