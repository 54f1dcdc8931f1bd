"""An app whose periodic job has an unparseable cron expression (fails at import)."""

from __future__ import annotations

import errands

app = errands.App()


@app.periodic("61 25 * * *", name="fuzz.nightly")
def nightly() -> None:
    pass
