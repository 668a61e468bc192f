"""The ground floor every other package stands on: errors, the experiment record, the objective, byte units."""
