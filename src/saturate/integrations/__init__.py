"""What a user imports into a run of their own: `SaturateCallback` for a Transformers `Trainer`
(`integrations.transformers`) or a Lightning `Trainer` (`integrations.lightning`), thin adapters over
`callback.RunWatch`. Nothing is imported here, so importing one framework's callback never imports the other's."""
