//! XLA's collectives extension (API 0.5, extension type 129): the communicator of the devices a
//! call runs with, for a handler that runs its own collective operations (an all-reduce inside
//! a custom call, a fused communication kernel).
//!
//! The runtime attaches it to the invoke context of a call where it supports it; a handler finds
//! it with [`super::context::Context::collectives`]. The protocol is XLA's: the prepare stage
//! *requests* a communicator for some replica groups, XLA acquires every clique requested before
//! the execution, and the initialize and execute stages *get* the one they requested. The
//! communicator is the backend's own object (`ncclComm_t` on XLA:GPU), handed over as an opaque,
//! non-owning pointer for the handler to give to the backend's library.
//!
//! Which runtimes attach it, as run: jaxlib 0.12.0.1's CPU runtime does not (no extension 129 at
//! instantiate or execute, on one device or under `shard_map` on two; it calls neither prepare
//! nor initialize), and jaxlib 0.10.2 (API 0.3) has no extensions at all. The crate's tests run
//! it against the fake runtime's extension.

use std::marker::PhantomData;
use std::mem::{offset_of, size_of};
use std::ptr::{self, NonNull};

use super::api::Api;
use super::error::{FfiError, FfiResult};
use super::stage::Stage;
use super::sys::v0_5::{self, XLA_FFI_CollectiveGroupMode as RawMode};

/// How the replica groups of a request name devices (XLA's `CollectiveOpGroupMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupMode {
    /// Ids are replica ids; each group spans the replicas of one partition.
    CrossReplica,
    /// Ids are partition ids; each group spans the partitions of one replica.
    CrossPartition,
    /// Ids are replica ids; each group spans those replicas in every partition.
    CrossReplicaAndPartition,
    /// Ids are flattened (replica, partition) ids.
    FlattenedId,
}

impl GroupMode {
    fn to_raw(self) -> RawMode {
        match self {
            GroupMode::CrossReplica => RawMode::CROSS_REPLICA,
            GroupMode::CrossPartition => RawMode::CROSS_PARTITION,
            GroupMode::CrossReplicaAndPartition => RawMode::CROSS_REPLICA_AND_PARTITION,
            GroupMode::FlattenedId => RawMode::FLATTENED_ID,
        }
    }
}

/// A backend's communicator, owned by the runtime for the execution: `as_raw` is what the
/// backend's library takes (cast it to `ncclComm_t` on XLA:GPU). Never dereferenced here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Communicator(NonNull<v0_5::XLA_FFI_Communicator>);

impl Communicator {
    /// The backend's handle.
    pub fn as_raw(&self) -> *mut v0_5::XLA_FFI_Communicator {
        self.0.as_ptr()
    }
}

/// The collectives extension of one call, valid for that call (`'a`). Held as a raw pointer,
/// not a reference: the runtime's extension may be a larger object of its own, which its
/// functions reach through the pointer handed back to them (and may change during the call).
#[derive(Clone, Copy)]
pub struct Collectives<'a> {
    raw: NonNull<v0_5::XLA_FFI_Collectives_Extension>,
    api: Api<'a>,
    stage: Stage,
    _life: PhantomData<&'a v0_5::XLA_FFI_Collectives_Extension>,
}

impl<'a> Collectives<'a> {
    /// Checks an extension of type 129 the runtime attached: its major version is the
    /// mirror's, and it is long enough for the communicator's two functions (the window
    /// functions after them, which this wrapper does not call, may be missing from an older
    /// minor version).
    ///
    /// # Safety
    /// `extension` must point to an extension of type 129 that lives for `'a`, readable for its
    /// `struct_size`.
    pub(crate) unsafe fn from_raw(
        extension: NonNull<v0_5::XLA_FFI_Extension>,
        api: Api<'a>,
        stage: Stage,
    ) -> FfiResult<Collectives<'a>> {
        // SAFETY: the head of an extension is readable (caller's contract).
        let head = unsafe { extension.as_ptr().read() };
        let (major, minor) = (head.id.major_version, head.id.minor_version);
        let mirrored = (
            v0_5::XLA_FFI_Extension_Collectives_MajorVersion,
            v0_5::XLA_FFI_Extension_Collectives_MinorVersion,
        );
        if major != mirrored.0 {
            return Err(FfiError::Unimplemented(format!(
                "the runtime's collectives extension is version {major}.{minor}; this crate \
                 speaks {}.{}",
                mirrored.0, mirrored.1
            )));
        }
        let needed =
            offset_of!(v0_5::XLA_FFI_Collectives_Extension, get_communicator) + size_of::<usize>();
        if head.struct_size < needed {
            return Err(FfiError::Unimplemented(format!(
                "the runtime's collectives extension (version {major}.{minor}, {} bytes) ends \
                 before its communicator functions ({needed} bytes)",
                head.struct_size
            )));
        }
        Ok(Collectives {
            raw: extension.cast(),
            api,
            stage,
            _life: PhantomData,
        })
    }

    /// The extension's version (major, minor).
    pub fn version(&self) -> (i32, i32) {
        // SAFETY: the head is readable for the call (`from_raw`'s contract).
        let id = unsafe { ptr::addr_of!((*self.raw.as_ptr()).extension_base.id).read() };
        (id.major_version, id.minor_version)
    }

    fn check_stage(&self, what: &str, allowed: &[Stage]) -> FfiResult<()> {
        if allowed.contains(&self.stage) {
            return Ok(());
        }
        let names: Vec<&str> = allowed.iter().map(|s| s.name()).collect();
        Err(FfiError::failed_precondition(format!(
            "{what} is for the {} stage, not {}: XLA acquires what prepare requests before the \
             execution, and hands it out from initialize on",
            names.join(" or "),
            self.stage
        )))
    }

    /// Asks XLA to acquire a communicator for `groups` (device ids named as `mode` says)
    /// before the execution. Prepare stage only.
    pub fn request_communicator(
        &self,
        mode: GroupMode,
        groups: &ReplicaGroups,
        communication_id: i64,
    ) -> FfiResult<()> {
        self.check_stage("requesting a communicator", &[Stage::Prepare])?;
        // SAFETY: `from_raw` checked that the extension covers its communicator functions.
        let request = unsafe { ptr::addr_of!((*self.raw.as_ptr()).request_communicator).read() };
        let request = request.ok_or_else(|| {
            FfiError::Unimplemented("the collectives extension has no request_communicator".into())
        })?;
        let mut args = request_args(mode, groups, communication_id);
        // SAFETY: `args` and the groups it points to are valid for the call; `raw` is the
        // runtime's extension, passed back as its `self` with the provenance the runtime gave.
        let err = unsafe { request(self.raw.as_ptr(), &mut args) };
        self.api.check("XLA_FFI_Communicator_Request", err)
    }

    /// The communicator XLA acquired for the same `groups` and `communication_id` that the
    /// prepare stage requested. Initialize and execute stages; allocates nothing.
    pub fn communicator(
        &self,
        mode: GroupMode,
        groups: &ReplicaGroups,
        communication_id: i64,
    ) -> FfiResult<Communicator> {
        self.check_stage(
            "getting a communicator",
            &[Stage::Initialize, Stage::Execute],
        )?;
        // SAFETY: as in `request_communicator`.
        let get = unsafe { ptr::addr_of!((*self.raw.as_ptr()).get_communicator).read() };
        let get = get.ok_or_else(|| {
            FfiError::Unimplemented("the collectives extension has no get_communicator".into())
        })?;
        let mut args = v0_5::XLA_FFI_Communicator_Get_Args {
            request: request_args(mode, groups, communication_id),
            communicator: ptr::null_mut(),
        };
        args.request.struct_size = v0_5::XLA_FFI_Communicator_Get_Args::STRUCT_SIZE;
        // SAFETY: as in `request_communicator`; the runtime writes the communicator.
        let err = unsafe { get(self.raw.as_ptr(), &mut args) };
        self.api.check("XLA_FFI_Communicator_Get", err)?;
        NonNull::new(args.communicator)
            .map(Communicator)
            .ok_or_else(|| {
                FfiError::failed_precondition(
                "XLA has no communicator for these groups (did the prepare stage request them?)",
            )
            })
    }
}

/// Replica groups (device ids, each group a list) in the layout XLA reads, made once (at
/// instantiate, kept in the state) so that asking for a communicator at execute allocates
/// nothing.
#[derive(Debug)]
pub struct ReplicaGroups {
    /// The ids; `raw` points into these boxes, which never move or change.
    ids: Vec<Box<[i64]>>,
    raw: Vec<v0_5::XLA_FFI_ReplicaGroup>,
}

// SAFETY: `raw` holds pointers into `ids`' boxes, owned by the same value and never changed
// after `new`: sharing or moving it across threads shares or moves plain integers.
unsafe impl Send for ReplicaGroups {}
// SAFETY: as above; nothing is mutated through a shared reference.
unsafe impl Sync for ReplicaGroups {}

impl ReplicaGroups {
    /// The groups `groups`, copied.
    pub fn new(groups: &[&[i64]]) -> ReplicaGroups {
        let ids: Vec<Box<[i64]>> = groups.iter().map(|g| Box::from(*g)).collect();
        let raw = ids
            .iter()
            .map(|g| v0_5::XLA_FFI_ReplicaGroup {
                ids: g.as_ptr(),
                size: g.len(),
            })
            .collect();
        ReplicaGroups { ids, raw }
    }

    /// The groups' ids.
    pub fn groups(&self) -> impl Iterator<Item = &[i64]> {
        self.ids.iter().map(|g| &g[..])
    }
}

/// The request's C args; they point into `groups`, so must not outlive them.
fn request_args(
    mode: GroupMode,
    groups: &ReplicaGroups,
    communication_id: i64,
) -> v0_5::XLA_FFI_Communicator_Request_Args {
    v0_5::XLA_FFI_Communicator_Request_Args {
        struct_size: v0_5::XLA_FFI_Communicator_Request_Args::STRUCT_SIZE,
        extension_start: ptr::null_mut(),
        group_mode: mode.to_raw(),
        groups: groups.raw.as_ptr(),
        num_groups: groups.raw.len(),
        communication_id,
    }
}
