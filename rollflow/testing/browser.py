"""The Prefect UI in a real browser: the run deployment's form filled and submitted, a flow run's
page and its artifacts, each with a screenshot.

Drives the distribution's Chromium (Debian's ``chromium`` package, ``/usr/bin/chromium``) with
Playwright; Playwright's own browser download is never used. Used by the run-form test
(``tests/integration/flows/test_deployment.py``, riding on its deployed run) and by
``scripts/ui_screenshots.py``, which makes the docs' screenshots. Every wait has a deadline and
says what it waited for.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# As the machine's probe starts it: no sandbox (root), no GPU, and none of the background
# connections that a closed network refuses at every start.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PAGE_S = 60.0  # a page's load and render
SUBMIT_S = 60.0  # the form's submit: the API validates the parameters, then makes the flow run


def chromium() -> str | None:
    """The distribution's Chromium, or None where it is not installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class FormRun:
    """What the browser saw of the run form and the run it submitted."""

    labels: list[str]  # every field's label on the form, in order ("Num Steps (Optional)", ...)
    values: dict[str, str]  # the value a few named fields showed before any edit
    flow_run_id: str = ""
    state: str = ""  # the flow run's state type at the end
    artifacts_text: str = ""  # the finished run's Artifacts tab
    plot_width: int = 0  # the width of the curves artifact's plot as the browser drew it
    shots: list[Path] = field(default_factory=list)


@contextmanager
def browser(viewport: tuple[int, int] = (1400, 1800)) -> Iterator[Any]:
    """A page of a headless Chromium (closed at the end)."""
    from playwright.sync_api import sync_playwright

    path = chromium()
    if path is None:
        raise RuntimeError(
            "no Chromium: install the distribution's package (apt-get install chromium)"
        )
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        try:
            page = b.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            page.set_default_timeout(PAGE_S * 1000)
            yield page
        finally:
            b.close()


def _api(api: str, path: str, body: dict | None = None) -> Any:
    """The Prefect API's answer at ``api`` + ``path``: a GET, or a POST of ``body`` as JSON."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{api}{path}", data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.load(r)


def deployment_id(api: str, name: str) -> str:
    """The id of deployment ``flow/deployment`` on the server at ``api``."""
    return _api(api, f"/deployments/name/{name}")["id"]


def submit_run_form(
    page: Any,
    ui: str,
    api: str,
    deployment: str,
    fields: dict[str, str],
    overrides: list[str],
    shots: Path,
    read: tuple[str, ...] = (),
) -> FormRun:
    """Open deployment ``deployment``'s (its id) run form at ``ui`` (its API at ``api``), record its labels and the
    values of the ``read`` fields, type ``fields`` (label → value) and one ``overrides`` item
    each, screenshot it (``shots/run-form.png``), submit; the id of the flow run it made."""
    page.goto(f"{ui}/deployments/deployment/{deployment}/run", wait_until="networkidle")
    page.get_by_text("Parameters", exact=True).wait_for()
    page.get_by_text("overrides (Optional)").wait_for()
    labels = [t.strip() for t in page.locator("form label").all_inner_texts() if t.strip()]
    values = {name: _field(page, name).input_value() for name in read}
    for name, value in fields.items():
        _field(page, name).fill(value)
    items = _section(page, "overrides (Optional)")
    for i, item in enumerate(overrides):
        items.get_by_role("button", name="Add item").click()
        items.locator("input, textarea").nth(i).fill(item)
    shots.mkdir(parents=True, exist_ok=True)
    form_shot = shots / "run-form.png"
    page.screenshot(path=str(form_shot))
    before = set(_flow_runs_of(api, deployment))
    page.wait_for_load_state("networkidle")
    submit = page.get_by_role("button", name="Submit")
    # The UI validates the parameters with the API, creates the flow run and goes back to the
    # deployment's page; the flow run is the one the API has anew. A refused request shows
    # "Something went wrong" and makes nothing: a failure, said with what the page shows (the
    # server is rollflow ui's, whose writers take turns: the stock one refused them under load).
    try:
        submit.scroll_into_view_if_needed()
        submit.click()
        end = time.monotonic() + SUBMIT_S
        while not (new := set(_flow_runs_of(api, deployment)) - before):
            if page.get_by_text("Something went wrong").count():
                raise RuntimeError("the UI said: Something went wrong")
            if time.monotonic() > end:
                raise TimeoutError(f"no new flow run within {SUBMIT_S:.0f}s of the submit")
            time.sleep(1.0)
    except Exception as exc:  # noqa: BLE001 - said with what the page shows
        shot = shots / "run-form-after-submit.png"
        page.screenshot(path=str(shot), full_page=True)
        shown = " | ".join(
            t.strip()
            for t in page.locator("[role=alert], .p-message, .p-toast").all_inner_texts()
            if t.strip()
        )
        raise AssertionError(
            f"the run form's Submit made no flow run ({exc}); the page at {page.url} shows: "
            f"{shown or '(no message)'}; see {shot}"
        ) from None
    flow_run_id = sorted(new)[0]
    return FormRun(labels=labels, values=values, flow_run_id=flow_run_id, shots=[form_shot])


def _flow_runs_of(api: str, deployment: str) -> list[str]:
    runs = _api(api, "/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [deployment]}}})
    return [run["id"] for run in runs]


def shoot_flow_run(page: Any, ui: str, flow_run_id: str, path: Path, tab: str = "") -> str:
    """Screenshot flow run ``flow_run_id``'s page (its ``tab``, e.g. Artifacts) to ``path``;
    its text."""
    page.goto(f"{ui}/runs/flow-run/{flow_run_id}", wait_until="networkidle")
    if tab:
        page.get_by_role("tab", name=tab).or_(page.get_by_text(tab, exact=True)).first.click()
        page.wait_for_load_state("networkidle")
    time.sleep(1.0)  # the tab's cards render after the data arrives
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path))
    return page.inner_text("body")


def shoot_artifact(page: Any, ui: str, api: str, key: str, path: Path) -> int:
    """Open the latest version of artifact ``key`` in the UI and screenshot it to ``path``; the
    width in pixels of the picture it shows (0: none drawn; an inline PNG the UI's sanitizer
    stripped would show none)."""
    (artifact,) = _api(
        api,
        "/artifacts/filter",
        {"artifacts": {"key": {"any_": [key]}}, "sort": "CREATED_DESC", "limit": 1},
    )
    page.goto(f"{ui}/artifacts/artifact/{artifact['id']}", wait_until="networkidle")
    image = page.locator("img[src^='data:image/png']").first
    width = 0
    try:
        image.wait_for(timeout=PAGE_S * 1000)
        width = int(image.evaluate("img => img.complete ? img.naturalWidth : 0"))
    except Exception:  # noqa: BLE001 - no picture: said by the width, 0
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)
    return width


def wait_for(predicate: Callable[[], Any], deadline_s: float, what: str) -> Any:
    """``predicate()``'s first truthy value; ``TimeoutError`` naming ``what`` after the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(1.0)
    raise TimeoutError(f"{what}: not within {deadline_s:.0f}s")


def _label(page: Any, label: str) -> Any:
    """The form's label whose text is exactly ``label`` ("Num Steps (Optional)")."""
    exactly = re.compile(rf"^\s*{re.escape(label)}\s*$")
    return page.locator("form label").filter(has_text=exactly).first


def _section(page: Any, label: str) -> Any:
    """The form's block of the field labelled ``label`` (its label, description and input)."""
    return _label(page, label).locator("xpath=../..")


def _field(page: Any, label: str) -> Any:
    """The input of the field labelled ``label``."""
    for_id = _label(page, label).get_attribute("for")
    if for_id:
        by_id = page.locator(f"[id='{for_id}']")
        if by_id.count():
            return by_id.first
    return _section(page, label).locator("input, textarea").first
