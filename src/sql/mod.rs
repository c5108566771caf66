//! Every SQL statement the Rust code runs, one submodule per concern, and the
//! fragments several statements share.

pub mod claim;
pub mod log;
pub mod publish;
pub mod registry;
pub mod topics;
pub mod worker;

/// SQL expression: the attempt history `$h` (a jsonb array, or NULL) with the entry
/// `$e` appended, bounded to 20 elements. Once full, the history keeps the first
/// failure, then `{"omitted": n}` (failures dropped so far), then the latest 18:
/// `max_attempts` may be up to 1,000,000 (and `outbox.max_attempts` is a user
/// setting), so an unbounded history could grow one row past any size.
/// claim() (expired leases) and fail() both append through this one expression.
#[macro_export]
macro_rules! history_append {
    ($h:literal, $e:literal) => {
        concat!(
            "CASE WHEN jsonb_array_length(COALESCE(",
            $h,
            ", '[]'::jsonb)) < 20 ",
            "THEN COALESCE(",
            $h,
            ", '[]'::jsonb) || jsonb_build_array(",
            $e,
            ") ",
            // Keep the first, the marker and the latest 17 (+ the new one); a longer
            // history (written before the bound) is cut to size on its next failure.
            "ELSE jsonb_build_array(", $h, " -> 0, jsonb_build_object('omitted', ",
            "COALESCE((", $h, " -> 1 ->> 'omitted')::int8, 0) + jsonb_array_length(", $h, ") - 18 ",
            "- CASE WHEN ", $h, " -> 1 ? 'omitted' THEN 1 ELSE 0 END)) ",
            "|| jsonb_path_query_array(", $h, ", '$[last - 16 to last]') || jsonb_build_array(", $e, ")",
            " END"
        )
    };
}
