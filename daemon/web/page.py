"""`WebPage`: the publisher, the actions and the HTTP server of one daemon's page, wired up.

page = WebPage("127.0.0.1:8080", source=PageSource(service, address, 0.2),
               control=control_service, security=SecurityConfig())
page.start()   # page.url: http://127.0.0.1:8080/
page.stop()
"""

from __future__ import annotations

from plait.daemon.control_service import ControlService
from plait.daemon.security import SecurityConfig
from plait.daemon.web.actions import Actions
from plait.daemon.web.history import DEFAULT_HISTORY_SECONDS, MfuHistory
from plait.daemon.web.live import Publisher
from plait.daemon.web.page_data import PageSource
from plait.daemon.web.page_server import PageServer

DEFAULT_INTERVAL_SECONDS = 1.0


class WebPage:
    def __init__(
        self,
        bind: str,
        *,
        source: PageSource,
        control: ControlService,
        security: SecurityConfig,
        interval: float = DEFAULT_INTERVAL_SECONDS,
    ) -> None:
        history = MfuHistory(capacity=int(DEFAULT_HISTORY_SECONDS / interval))
        self.publisher = Publisher(source.document, interval=interval, history=history)
        self.actions = Actions(control, source.address, source.service.extras.job_questions)
        self.server = PageServer(
            bind, publisher=self.publisher, actions=self.actions, security=security
        )

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> WebPage:
        self.publisher.start()
        self.server.start()
        return self

    def stop(self) -> None:
        self.publisher.stop()  # ends every open event stream first
        self.server.stop()
        self.actions.close()
