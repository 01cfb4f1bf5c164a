//! Python bindings of kvferry (being written).
