"""Acting: respond (findings -> the policy -> the executor) and the executor (action rows, sent,
acked, done; the outbox of alerts in the same transaction); outcome (what an action did).
May import: judge, decide, notify, store and the root modules."""
