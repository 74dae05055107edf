"""The coordinator's admission and bans as they change while it runs: which live peers each round may plan.

`gate.py` holds the rules (pure); `Gatekeeper` holds what they are applied to and says what they decide:
the allow-list, read again whenever its file changes (a file that no longer parses keeps the last good
list), the bans judged each round from the peers' reports, and who is left out of plans and why.
"""

from __future__ import annotations

from hetpeer.coordinator import gate
from hetpeer.protocol.admission import AdmissionError, Allowlist
from hetpeer.protocol.records import PeerRecord


class Gatekeeper:
    """Mixed into `service.Coordinator`, which sets up the state it keeps (`admission`, `_allowlist_mtime`,
    `bans`, `refused`, `disputed`, `apart`) and whose `config`, `plan`, `ledger`, `report`, `_event` and `_log_once` it
    uses."""

    def _gate(self, live: dict[str, PeerRecord], now: float) -> dict[str, PeerRecord]:
        """The live peers the planner may use: admitted and not banned (bans judged from the records first)."""
        self._read_allowlist()
        before = self.bans
        if self.config.ban_period_s > 0:
            self.disputed, lines = gate.disputes(self.plan, live, self.disputed, now)
            for line in lines:
                self.report(line)
        self.bans, news = gate.judge(self.plan, live, self.bans, now, self.config.ban_period_s, self.disputed)
        for line in news:
            self._event("ban", line)
        for device, ban in self.bans.items():  # banned now: its work under the running plan is taken back
            if ban.until > now and (device not in before or before[device].until <= now):
                # its disputes are settled, as accused or accuser: its word against a partner's counts no more
                self.disputed = {key: at for key, at in self.disputed.items() if device not in key}
                if self.plan is not None and self.ledger.void(device, self.plan.epoch, now):
                    self._event("credit", f"voided {device}'s credit for plan epoch {self.plan.epoch}, where it was banned")
        self.apart = gate.apart(self.disputed)
        kept, self.refused = gate.plannable(live, self.admission, self.bans, now)
        for device, why in self.refused.items():
            if device not in self.bans or self.bans[device].until <= now:  # a ban was said when it began
                self._log_once(device, f"left {device} out of plans: {why}", kind="refused")
        return kept

    def _read_allowlist(self) -> None:
        """(Re)read the allow-list when its file changed; a file that no longer parses keeps the last good list."""
        path = self.config.allowlist
        if path is None:
            return
        try:
            mtime = path.stat().st_mtime
        except OSError as error:
            if self._allowlist_mtime is None:
                raise AdmissionError(f"cannot read allow-list {path}: {error.strerror}") from None
            self._log_once("allowlist", f"cannot read allow-list {path} ({error.strerror}): keeping the last one read")
            return
        if mtime == self._allowlist_mtime:
            return
        try:
            allowlist = Allowlist.read(path)
        except AdmissionError as error:
            if self._allowlist_mtime is None:
                raise
            self._log_once("allowlist", f"{error}: keeping the last allow-list read")
            return
        first = self._allowlist_mtime is None
        self.admission, self._allowlist_mtime = gate.Admission("allowlist", allowlist=allowlist), mtime
        if not first:
            self.report(f"read allow-list {path} again: {self._admission_words()}")

    def _admission_words(self) -> str:
        admission = self.admission
        if admission.mode == "allowlist":
            return (f"peers on allow-list {self.config.allowlist} ({len(admission.allowlist.devices)} device id(s), "
                    f"{len(admission.allowlist.fingerprints)} key fingerprint(s))")
        return "peers with a join token of this coordinator (hetpeer invite)" if admission.mode == "token" else "open to every peer"
