"""The ddpscope dashboard: server-rendered HTML shells plus small scripts that draw the collector's JSON API.

Usage (the collector does this in ``create_app``)::

    from ddpscope.dashboard import router
    app.include_router(router)

Pages: ``/`` (job list), ``/jobs/{job}`` (live job page), ``/jobs/{job}/steps/{step}`` (overlap timeline),
``/jobs/{job}/incidents`` (cross-rank diagnosis). The router also serves its own scripts under
``/dashboard-static/`` and plotly.js from the installed ``plotly`` package at ``/static/plotly.min.js``:
nothing loads from the internet. The dashboard never computes analysis itself; every number it shows
comes from ``/api/v1/...``. It imports neither torch nor the server package.
"""

from ddpscope.dashboard.routes import router

__all__ = ["router"]
