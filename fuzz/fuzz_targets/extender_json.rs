//! Fuzzes the extender's request decoders: the same bytes go to the `ExtenderArgs` decoder
//! (filter and prioritize bodies) and the `ExtenderBindingArgs` decoder (bind bodies). They
//! must answer `Ok` or a `DecodeError`, never panic, whatever the scheduler (or anyone who
//! can reach the port) sends.

#![no_main]

use gpushare::extender::wire::{decode_binding_args, decode_extender_args};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(args) = decode_extender_args(data) {
        let _ = args.candidates.names();
    }
    let _ = decode_binding_args(data);
});
